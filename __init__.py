"""ComfyUI entry point of the h3-stream node pack.

ComfyUI imports this module from `custom_nodes/`. The V3 nodes arrive with the nodes issue; until then the pack
registers nothing. `NODE_CLASS_MAPPINGS` is deliberately never defined here: ComfyUI would then ignore
`comfy_entrypoint`.
"""

WEB_DIRECTORY = "./web"
