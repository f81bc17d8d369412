"""A minimal executor for API-format prompts, following ComfyUI 0.33.0's `execution.py` rules that matter here:

validation (known class types, required inputs, link shape and type, INT / FLOAT / STRING / BOOLEAN conversion,
min / max and combo checks skipped for inputs a node's `validate_inputs` takes by name, `validate_inputs` called with
linked inputs as None and a failed verdict reported once per input it takes) and execution (only what output nodes
need, each node once, dependencies first, a per-run class clone carrying `hidden`, linked values passed by reference,
absent optional inputs not passed) and the output
cache across prompts (a node whose class, inputs, upstream and `fingerprint_inputs` value are unchanged is not run
again; a NaN fingerprint never matches, so such a node always runs; `not_idempotent` nodes share no cache entry with
other nodes).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

from comfy_api.latest import io
from comfy_api.latest._io import HiddenHolder, overrides

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


class PromptError(Exception):
    """The prompt failed validation; `errors` lists (node id, message)."""

    def __init__(self, errors: list[tuple[str, str]]):
        super().__init__("; ".join(f"node {node}: {message}" for node, message in errors))
        self.errors = errors


@dataclass
class RunResult:
    outputs: dict = field(default_factory=dict)  # node id -> tuple of output values
    ui: dict = field(default_factory=dict)  # node id -> ui dict
    order: list = field(default_factory=list)  # node ids in execution order


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _types_match(received: str, expected: str) -> bool:
    if "*" in (received, expected):
        return True
    return bool(set(received.split(",")) & set(expected.split(",")))


def live_inputs(sockets: list, values: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(prompt key, socket) of every input the prompt's values make live: a dynamic combo's chosen option adds its
    inputs under `<combo key>.<input id>` (ComfyUI's `get_finalized_class_inputs`); a combo holding an unknown key is
    left out with them (ComfyUI neither validates it nor passes it)."""
    live = []
    for socket in sockets:
        key = prefix + socket.id
        if isinstance(socket, io.DynamicCombo.Input):
            option = socket.option(values.get(key))
            if option is not None:  # an unknown key: ComfyUI drops the combo, unvalidated and not passed
                live.append((key, socket))
                live.extend(live_inputs(option.inputs, values, key + "."))
            continue
        live.append((key, socket))
    return live


def nested_inputs(sockets: list, values: dict, prefix: str = "") -> dict:
    """The keyword arguments ComfyUI passes: a dynamic combo becomes one dict of its key and its chosen option's
    inputs, None for those the prompt leaves out (`build_nested_inputs`)."""
    arguments = {}
    for socket in sockets:
        key = prefix + socket.id
        if not isinstance(socket, io.DynamicCombo.Input):
            if key in values:
                arguments[socket.id] = values[key]
            continue
        option = socket.option(values.get(key))
        if option is None:
            continue
        chosen = {socket.id: values[key]}
        inner = nested_inputs(option.inputs, values, key + ".")
        chosen.update({i.id: inner.get(i.id) for i in option.inputs})
        arguments[socket.id] = chosen
    return arguments


def _run(value):
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class PromptExecutor:
    def __init__(self, node_classes: dict[str, type]):
        self.node_classes = dict(node_classes)
        self.cache: dict = {}  # input signature -> outputs, kept across prompts like ComfyUI's output cache

    def _schema(self, class_type: str) -> io.Schema:
        return self.node_classes[class_type].GET_SCHEMA()

    # ---- validation ------------------------------------------------------------------------------------------------

    def validate(self, prompt: dict) -> None:
        errors: list[tuple[str, str]] = []
        outputs = [node for node, spec in prompt.items()
                   if spec.get("class_type") in self.node_classes and self._schema(spec["class_type"]).is_output_node]
        if not outputs:
            raise PromptError([("-", "prompt has no output node")])
        for node_id, spec in prompt.items():
            class_type = spec.get("class_type")
            if class_type not in self.node_classes:
                errors.append((node_id, f"unknown class_type {class_type!r}"))
                continue
            errors.extend((node_id, message) for message in self._validate_node(prompt, node_id, spec))
        if errors:
            raise PromptError(errors)

    def _validate_node(self, prompt: dict, node_id: str, spec: dict) -> list[str]:
        node_class = self.node_classes[spec["class_type"]]
        schema = self._schema(spec["class_type"])
        inputs = spec.get("inputs", {})
        validate_names: list[str] = []
        validate_kwargs = False
        if overrides(node_class, "validate_inputs"):
            argspec = inspect.getfullargspec(node_class.validate_inputs)
            validate_names, validate_kwargs = argspec.args[1:], argspec.varkw is not None
        errors = []
        for key, socket in live_inputs(schema.inputs, inputs):
            if key not in inputs:
                if not socket.optional:
                    errors.append(f"required input {key!r} is missing")
                continue
            value = inputs[key]
            expected = socket.get_io_type()
            if _is_link(value):
                source, slot = value
                if source not in prompt:
                    errors.append(f"{key} links to missing node {source}")
                    continue
                source_outputs = self._schema(prompt[source]["class_type"]).outputs
                if slot >= len(source_outputs):
                    errors.append(f"{key} links to output {slot} of node {source}, which has "
                                  f"{len(source_outputs)}")
                    continue
                received = source_outputs[slot].io_type
                if not _types_match(received, expected):
                    errors.append(f"{key}: received {received}, expects {expected}")
                continue
            if isinstance(value, list):
                errors.append(f"{key}: a list must be a [node_id, slot] link")
                continue
            try:
                value = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}.get(expected, lambda v: v)(value)
            except (TypeError, ValueError) as error:
                errors.append(f"{key}: cannot convert {value!r} to {expected} ({error})")
                continue
            inputs[key] = value
            if key in validate_names or validate_kwargs:
                continue
            low, high = getattr(socket, "min", None), getattr(socket, "max", None)
            if low is not None and value < low:
                errors.append(f"{key}: {value} is smaller than min {low}")
            if high is not None and value > high:
                errors.append(f"{key}: {value} is bigger than max {high}")
            if expected == "COMBO" and value not in socket.options:
                errors.append(f"{key}: {value!r} not in {socket.options}")
        if validate_names or validate_kwargs:
            values = {name: (None if _is_link(value) else value) for name, value in inputs.items()}
            taken = {name: values.get(name) for name in (values if validate_kwargs else validate_names)}
            # Like ComfyUI, the dynamic combos' dicts come too, whether or not validate_inputs names them.
            dynamic = {name: value for name, value in nested_inputs(schema.inputs, values).items()
                       if isinstance(value, dict)}
            verdict = _run(node_class.validate_inputs(**{**taken, **dynamic}))
            if verdict is not True:  # ComfyUI reports it under every input validate_inputs takes
                errors.extend(f"{name} - custom validation failed: {verdict}" for name in taken)
        return errors

    # ---- execution -------------------------------------------------------------------------------------------------

    def _signature(self, prompt: dict, node_id: str, memo: dict):
        if node_id in memo:
            return memo[node_id]
        spec = prompt[node_id]
        node_class = self.node_classes[spec["class_type"]]
        schema = self._schema(spec["class_type"])
        parts = []
        for name, value in sorted(spec["inputs"].items()):
            parts.append((name, ("link", self._signature(prompt, value[0], memo), value[1]) if _is_link(value)
                          else repr(value)))
        if overrides(node_class, "fingerprint_inputs"):
            constants = {k: v for k, v in spec["inputs"].items() if not _is_link(v)}
            arguments = nested_inputs(schema.inputs, constants)
            parts.append(("fingerprint", _run(node_class.fingerprint_inputs(**arguments))))
        memo[node_id] = (spec["class_type"], tuple(parts), node_id if schema.not_idempotent else None)
        return memo[node_id]

    def run(self, prompt: dict, extra_pnginfo: dict | None = None) -> RunResult:
        self.validate(prompt)
        result = RunResult()
        self._memo = {}
        targets = [node for node, spec in prompt.items() if self._schema(spec["class_type"]).is_output_node]
        for node_id in targets:
            self._execute(prompt, node_id, result, extra_pnginfo, visiting=set())
        return result

    def _execute(self, prompt: dict, node_id: str, result: RunResult, extra_pnginfo, visiting: set) -> tuple:
        if node_id in result.outputs:
            return result.outputs[node_id]
        if node_id in visiting:
            raise PromptError([(node_id, "dependency cycle")])
        spec = prompt[node_id]
        node_class = self.node_classes[spec["class_type"]]
        schema = self._schema(spec["class_type"])
        signature = self._signature(prompt, node_id, self._memo)
        if signature in self.cache:
            result.outputs[node_id] = self.cache[signature]
            return self.cache[signature]
        visiting.add(node_id)
        values = {}
        for key, _ in live_inputs(schema.inputs, spec["inputs"]):
            if key not in spec["inputs"]:
                continue
            value = spec["inputs"][key]
            if _is_link(value):
                value = self._execute(prompt, value[0], result, extra_pnginfo, visiting)[value[1]]
            values[key] = value
        kwargs = nested_inputs(schema.inputs, values)
        hidden = {}
        for item in schema.hidden:
            hidden[item.value] = {io.Hidden.unique_id: node_id, io.Hidden.prompt: prompt,
                                  io.Hidden.extra_pnginfo: extra_pnginfo}.get(item)
        # ComfyUI runs each execution on a shallow clone of the class that carries the hidden values.
        clone = type(node_class.__name__, (node_class,), {"hidden": HiddenHolder(hidden)})
        output = _run(clone.execute(**kwargs))
        if isinstance(output, tuple):
            output = io.NodeOutput(*output)
        assert isinstance(output, io.NodeOutput), f"{spec['class_type']} returned {type(output).__name__}"
        values = tuple(output.args)
        assert len(values) == len(schema.outputs), \
            f"{spec['class_type']} returned {len(values)} values for {len(schema.outputs)} outputs"
        result.outputs[node_id] = values
        self.cache[signature] = values
        if output.ui is not None:
            result.ui[node_id] = output.ui if isinstance(output.ui, dict) else output.ui.as_dict()
        result.order.append(node_id)
        visiting.discard(node_id)
        return values


def run_node(node_class: type, node_id: str = "1", **inputs) -> tuple:
    """Execute one node as ComfyUI would inside a prompt (class clone carrying `hidden`), returning its outputs."""
    schema = node_class.GET_SCHEMA()
    hidden = {item.value: node_id if item is io.Hidden.unique_id else None for item in schema.hidden}
    clone = type(node_class.__name__, (node_class,), {"hidden": HiddenHolder(hidden)})
    output = _run(clone.execute(**inputs))
    return tuple(output.args)
