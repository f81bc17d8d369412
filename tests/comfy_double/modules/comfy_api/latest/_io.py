"""Test double of `comfy_api.latest.io` (V3 node schema).

Constructor signatures equal ComfyUI 0.33.0's (see contract/signatures.json). `node_info(cls)` serialises a node the
way `GET /object_info` does, so the double's reading of a schema can be compared with the real server's
(contract/object_info.json).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def _pruned(values: dict) -> dict:
    return {key: value for key, value in values.items() if value is not None}


class NumberDisplay(str, Enum):
    number = "number"
    slider = "slider"
    gradient_slider = "gradientslider"


class ControlAfterGenerate(str, Enum):
    fixed = "fixed"
    increment = "increment"
    decrement = "decrement"
    randomize = "randomize"


class Hidden(str, Enum):
    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    dynprompt = "DYNPROMPT"
    auth_token_comfy_org = "AUTH_TOKEN_COMFY_ORG"
    api_key_comfy_org = "API_KEY_COMFY_ORG"
    comfy_usage_source = "COMFY_USAGE_SOURCE"


# ---- sockets -------------------------------------------------------------------------------------------------------


class Input:
    io_type: str = None

    def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                 extra_dict=None, raw_link: bool = None, advanced: bool = None):
        self.id = id
        self.display_name = display_name
        self.optional = optional
        self.tooltip = tooltip
        self.lazy = lazy
        self.extra_dict = dict(extra_dict or {})
        self.raw_link = raw_link
        self.advanced = advanced

    def as_dict(self) -> dict:
        return _pruned({"display_name": self.display_name, "optional": self.optional, "tooltip": self.tooltip,
                        "lazy": self.lazy, "rawLink": self.raw_link, "advanced": self.advanced}) | \
            _pruned(self.extra_dict)

    def get_io_type(self) -> str:
        return self.io_type

    @property
    def is_widget(self) -> bool:
        return False


class WidgetInput(Input):
    def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None,
                 default: Any = None, socketless: bool = None, widget_type: str = None, force_input: bool = None,
                 extra_dict=None, raw_link: bool = None, advanced: bool = None):
        super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link, advanced)
        self.default = default
        self.socketless = socketless
        self.widget_type = widget_type
        self.force_input = force_input

    def as_dict(self) -> dict:
        return super().as_dict() | _pruned({"default": self.default, "socketless": self.socketless,
                                            "widgetType": self.widget_type, "forceInput": self.force_input})

    def get_io_type(self) -> str:
        return self.widget_type or self.io_type

    @property
    def is_widget(self) -> bool:
        return not self.force_input


class Output:
    io_type: str = None

    def __init__(self, id: str = None, display_name: str = None, tooltip: str = None, is_output_list=False):
        self.id = id
        self.display_name = display_name or id
        self.tooltip = tooltip
        self.is_output_list = is_output_list

    def get_io_type(self) -> str:
        return self.io_type


class ComfyType:
    """A socket type: `io_type` plus its `Input` and `Output` classes bound to it."""

    io_type: str = None
    Input = Input
    Output = Output


def _socket_type(name: str, io_type: str, input_base=Input, output_base=Output) -> type:
    bound_input = type("Input", (input_base,), {"io_type": io_type})
    bound_output = type("Output", (output_base,), {"io_type": io_type})
    return type(name, (ComfyType,), {"io_type": io_type, "Input": bound_input, "Output": bound_output})


def Custom(io_type: str) -> type:
    return _socket_type(f"Custom_{io_type}", io_type)


Image = _socket_type("Image", "IMAGE")
Audio = _socket_type("Audio", "AUDIO")
Video = _socket_type("Video", "VIDEO")
Latent = _socket_type("Latent", "LATENT")
AnyType = _socket_type("AnyType", "*")


class Boolean(ComfyType):
    io_type = "BOOLEAN"

    class Input(WidgetInput):
        io_type = "BOOLEAN"

        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, default: bool = None, label_on: str = None, label_off: str = None,
                     socketless: bool = None, force_input: bool = None, extra_dict=None, raw_link: bool = None,
                     advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.label_on, self.label_off = label_on, label_off

        def as_dict(self):
            return super().as_dict() | _pruned({"label_on": self.label_on, "label_off": self.label_off})

    class Output(Output):
        io_type = "BOOLEAN"


class Int(ComfyType):
    io_type = "INT"

    class Input(WidgetInput):
        io_type = "INT"

        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, default: int = None, min: int = None, max: int = None, step: int = None,
                     control_after_generate=None, display_mode: NumberDisplay = None, socketless: bool = None,
                     force_input: bool = None, extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.min, self.max, self.step = min, max, step
            self.control_after_generate = control_after_generate
            self.display_mode = display_mode

        def as_dict(self):
            return super().as_dict() | _pruned({
                "min": self.min, "max": self.max, "step": self.step,
                "control_after_generate": self.control_after_generate,
                "display": self.display_mode.value if self.display_mode else None})

    class Output(Output):
        io_type = "INT"


class Float(ComfyType):
    io_type = "FLOAT"

    class Input(WidgetInput):
        io_type = "FLOAT"

        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, default: float = None, min: float = None, max: float = None,
                     step: float = None, round: float = None, display_mode: NumberDisplay = None,
                     gradient_stops: list = None, socketless: bool = None, force_input: bool = None,
                     extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.min, self.max, self.step, self.round = min, max, step, round
            self.display_mode = display_mode
            self.gradient_stops = gradient_stops

        def as_dict(self):
            return super().as_dict() | _pruned({
                "min": self.min, "max": self.max, "step": self.step, "round": self.round,
                "display": self.display_mode, "gradient_stops": self.gradient_stops})

    class Output(Output):
        io_type = "FLOAT"


class String(ComfyType):
    io_type = "STRING"

    class Input(WidgetInput):
        io_type = "STRING"

        def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, multiline=False, placeholder: str = None, default: str = None,
                     dynamic_prompts: bool = None, socketless: bool = None, force_input: bool = None,
                     extra_dict=None, raw_link: bool = None, advanced: bool = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link, advanced)
            self.multiline, self.placeholder, self.dynamic_prompts = multiline, placeholder, dynamic_prompts

        def as_dict(self):
            return super().as_dict() | _pruned({"multiline": self.multiline, "placeholder": self.placeholder,
                                                "dynamicPrompts": self.dynamic_prompts})

    class Output(Output):
        io_type = "STRING"


class Combo(ComfyType):
    io_type = "COMBO"

    class Input(WidgetInput):
        io_type = "COMBO"

        def __init__(self, id: str, options=None, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, default=None, control_after_generate=None, upload=None, image_folder=None,
                     remote=None, socketless: bool = None, extra_dict=None, raw_link: bool = None,
                     advanced: bool = None):
            if isinstance(options, type) and issubclass(options, Enum):
                options = [member.value for member in options]
            if isinstance(default, Enum):
                default = default.value
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, None, extra_dict,
                             raw_link, advanced)
            self.options = options
            self.control_after_generate = control_after_generate

        def as_dict(self):
            return super().as_dict() | _pruned({"multiselect": False, "options": self.options,
                                                "control_after_generate": self.control_after_generate})

    class Output(Output):
        io_type = "COMBO"


class DynamicCombo(ComfyType):
    """A combo whose chosen option brings its own inputs. ComfyUI addresses them as `<combo id>.<input id>` in a
    prompt and passes the node one dict: `{<combo id>: key, <input id>: value, ...}` of the chosen option."""

    io_type = "COMFY_DYNAMICCOMBO_V3"

    class Option:
        def __init__(self, key: str, inputs: list):
            self.key = key
            self.inputs = inputs

        def as_dict(self) -> dict:
            return {"key": self.key, "inputs": input_dict_v1(self.inputs)}

    class Input(Input):
        io_type = "COMFY_DYNAMICCOMBO_V3"

        def __init__(self, id: str, options: list, display_name: str = None, optional=False, tooltip: str = None,
                     lazy: bool = None, extra_dict=None):
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
            self.options = options

        def as_dict(self) -> dict:
            return super().as_dict() | {"options": [option.as_dict() for option in self.options]}

        @property
        def is_widget(self) -> bool:
            return True

        def option(self, key):
            return next((option for option in self.options if option.key == key), None)


def input_dict_v1(inputs: list) -> dict:
    """Inputs as `/object_info` lists them: {"required": {id: [type, options]}, "optional": {...}}."""
    listed: dict = {"required": {}}
    for socket in inputs:
        options = socket.as_dict()
        options.pop("optional", None)
        listed.setdefault("optional" if socket.optional else "required", {})[socket.id] = [socket.get_io_type(),
                                                                                           options]
    return listed


# ---- schema and nodes ----------------------------------------------------------------------------------------------


@dataclass
class Schema:
    node_id: str
    display_name: str = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    search_aliases: list = field(default_factory=list)
    is_input_list: bool = False
    is_output_node: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    is_dev_only: bool = False
    is_api_node: bool = False
    price_badge: Any = None
    not_idempotent: bool = False
    enable_expand: bool = False
    accept_all_inputs: bool = False
    essentials_category: str = None
    has_intermediate_output: bool = False

    def validate(self) -> None:
        """ComfyUI refuses duplicate input or output ids when it registers a node."""
        for what, ids in (("Input", [i.id for i in self.inputs]), ("Output", [o.id for o in self.outputs])):
            duplicates = [name for name, count in Counter(ids).items() if count > 1 and name is not None]
            if duplicates:
                raise ValueError(f"{what} ids must be unique, but {duplicates} are not.")

    def finalize(self) -> None:
        if self.is_output_node:
            for hidden in (Hidden.prompt, Hidden.extra_pnginfo):
                if hidden not in self.hidden:
                    self.hidden.append(hidden)
        for index, output in enumerate(self.outputs):
            if output.id is None:
                output.id = f"_{index}_{output.io_type}_"


class HiddenHolder:
    """`cls.hidden` during execution; unknown names read as None."""

    def __init__(self, values: dict | None = None):
        self.__dict__.update({Hidden(key).name: value for key, value in (values or {}).items()})

    def __getattr__(self, name):
        return None


class NodeOutput:
    def __init__(self, *args: Any, ui=None, expand: dict = None, block_execution: str = None):
        self.args = args
        self.ui = ui
        self.expand = expand
        self.block_execution = block_execution

    @property
    def result(self):
        return self.args if self.args else None

    def __getitem__(self, index):
        return self.args[index]


class ComfyNode:
    hidden: HiddenHolder = HiddenHolder()

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs) -> NodeOutput:
        raise NotImplementedError

    @classmethod
    def validate_inputs(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def GET_SCHEMA(cls) -> Schema:
        schema = cls.define_schema()
        schema.finalize()
        schema.validate()
        return schema


def overrides(node_class: type, method: str) -> bool:
    """True when the node class defines `method` itself (ComfyUI ignores the base class's placeholders)."""
    return any(method in klass.__dict__ for klass in node_class.__mro__ if klass is not ComfyNode
               and issubclass(klass, ComfyNode))


def node_info(node_class: type, python_module: str = "custom_nodes.h3-stream") -> dict:
    """The node as `GET /object_info/<id>` shows it."""
    schema = node_class.GET_SCHEMA()
    inputs = input_dict_v1(schema.inputs)
    for hidden in schema.hidden:
        inputs.setdefault("hidden", {})[hidden.name] = [hidden.value]
    return {
        "input": inputs,
        "input_order": {key: list(value) for key, value in inputs.items()},
        "is_input_list": schema.is_input_list,
        "output": [o.io_type for o in schema.outputs],
        "output_is_list": [o.is_output_list for o in schema.outputs],
        "output_name": [o.display_name or o.io_type for o in schema.outputs],
        "output_tooltips": [o.tooltip for o in schema.outputs],
        "name": schema.node_id,
        "display_name": schema.display_name,
        "description": schema.description,
        "python_module": python_module,
        "category": schema.category,
        "output_node": schema.is_output_node,
        "has_intermediate_output": schema.has_intermediate_output,
        "deprecated": schema.is_deprecated,
        "experimental": schema.is_experimental,
        "search_aliases": list(schema.search_aliases) or None,
    }
