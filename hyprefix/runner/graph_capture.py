"""Capturing a compiled step as Inductor's callable of flat inputs, through public APIs only.

``torch.compile`` traces the step with Dynamo and hands the graph to a backend of ours
(``InductorCapture``, a custom backend: the public ``torch.compile(backend=...)`` API), which
compiles it with Inductor (``torch._inductor.compile``, the function the built-in "inductor"
backend runs) and returns a ``Recorder`` around the result. The step's first call through
Dynamo runs that recorder, which notes the flat inputs Dynamo gathered for it (every weight,
the K/V caches, the step's own tensors, its symbolic sizes) and what it returned. From then on
the step is called as a ``CapturedStep``: Inductor's callable with the same flat inputs and
this call's own tensors and sizes put in their places, without Dynamo's frame evaluation, its
guards or its bytecode gathering hundreds of module attributes each step (as vLLM dispatches
to its compiled code per batch size).

That is sound because nothing a guard checks changes between one engine's calls: the model,
its K/V tensors and recurrent states are the same objects, and only the sizes the graph made
symbolic vary. A flat input that is none of those, or an output the step did not return as
it is, refuses the capture (``CaptureError``), as does a size the caller asked to keep
symbolic that Dynamo specialised.

Dynamo caches the traced code on the step's code object, one entry per backend; a second
engine of the same shapes reuses the entry (no compile), and its first call records its own
tensors through the same recorder.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch


class CaptureError(RuntimeError):
    """A compiled step that cannot be called with flat inputs (see the module docstring)."""


_recording = threading.local()  # .calls: a list while a capture runs on this thread


class Recorder:
    """What the backend returns for one graph: Inductor's callable, and the graph's placeholder
    example values (fake tensors with symbolic sizes, SymInts) to map symbolic sizes by."""

    def __init__(self, compiled: Callable, placeholders: list[object]) -> None:
        self.compiled = compiled
        self.placeholders = placeholders

    def __call__(self, *flat):
        out = self.compiled(*flat)
        calls = getattr(_recording, "calls", None)
        if calls is not None:
            calls.append((self, flat, out))
        return out


class InductorCapture:
    """A Dynamo backend: Inductor with these options, its result wrapped in a ``Recorder``.
    One instance per set of options (``backend_for``): Dynamo reuses traced code only for the
    backend it was traced for."""

    def __init__(self, options: dict) -> None:
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Recorder:
        compiled = torch._inductor.compile(gm, example_inputs, options=self.options)
        placeholders = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
        return Recorder(compiled, placeholders)


_BACKENDS: dict[tuple, InductorCapture] = {}
_BACKENDS_LOCK = threading.Lock()


def backend_for(options: dict) -> InductorCapture:
    """The one backend of these options in this process (values compared by identity where
    they are objects, as Inductor's custom passes are)."""
    key = tuple(sorted((k, v if isinstance(v, int | str | float | bool) else id(v)) for k, v in options.items()))
    with _BACKENDS_LOCK:
        return _BACKENDS.setdefault(key, InductorCapture(options))


@dataclass
class CapturedStep:
    """A compiled step called straight: ``template`` is the recorded flat inputs with None where
    each call's own values go; ``slots`` says which, as (flat position, step-input index, dim):
    dim -1 puts that input itself there, a dim >= 0 its size along that dim (a symbolic size);
    ``picks`` takes the step's results out of the callable's outputs."""

    compiled: Callable
    template: list
    slots: list[tuple[int, int, int]]
    picks: list[int]

    def __call__(self, step_inputs: Sequence) -> tuple:
        call = self.template.copy()
        for i, which, dim in self.slots:
            value = step_inputs[which]
            call[i] = value if dim < 0 else value.shape[dim]
        out = self.compiled(*call)
        return tuple(out[j] for j in self.picks)


def capture(run: Callable[[], tuple], step_inputs: Sequence, lasting: Iterable[torch.Tensor],
            symbolic: Iterable[tuple[int, int]] = ()) -> tuple[CapturedStep, tuple]:
    """Run ``run()`` (one call of a ``torch.compile``d step whose backend is ``backend_for``) and
    capture it. ``step_inputs``: the tensors (or None) that change every call; ``lasting``: the
    tensors that live as long as the step (weights, caches, states); ``symbolic``: (input, dim)
    pairs Dynamo must have kept symbolic where the graph reads them. Returns the captured step and this run's result.
    Raises ``CaptureError`` where the step cannot be called with flat inputs."""
    _recording.calls = calls = []
    try:
        result = run()
    finally:
        _recording.calls = None
    if len(calls) != 1:
        raise CaptureError(f"the step ran {len(calls)} compiled graphs, not one")
    recorder, flat, outputs = calls[0]
    fakes = _input_fakes(recorder.placeholders, flat, step_inputs)
    slots = _input_slots(recorder.placeholders, flat, step_inputs, fakes, {id(t) for t in lasting})
    for which, dim in symbolic:  # an input the graph does not read (no block table without attention) is fine
        fake = fakes.get(which)
        if which in fakes and not (isinstance(fake, torch.Tensor) and isinstance(fake.shape[dim], torch.SymInt)):
            raise CaptureError(f"the graph specialised size {dim} of step input {which}")
    picks = [next((j for j, o in enumerate(outputs) if o is r), None) for r in result]
    if None in picks:
        raise CaptureError("the step returned a value the compiled graph did not")
    template = list(flat)
    for i, _, _ in slots:
        template[i] = None  # this call's inputs: not kept alive
    return CapturedStep(recorder.compiled, template, slots, picks), result


def _input_fakes(placeholders: list[object], flat: Sequence, step_inputs: Sequence) -> dict[int, object]:
    """Step-input index -> the graph's example value of it (a fake tensor with symbolic sizes),
    for each step input the graph reads."""
    out = {}
    for which, value in enumerate(step_inputs):
        position = next((i for i, v in enumerate(flat) if v is value), None) if value is not None else None
        if position is not None:
            out[which] = placeholders[position]
    return out


def _input_slots(placeholders: list[object], flat: Sequence, step_inputs: Sequence, fakes: dict[int, object],
                 lasting: set[int]) -> list[tuple[int, int, int]]:
    """Where each flat input comes from on later calls (``CapturedStep.slots``); lasting tensors
    stay in the template. A symbolic size is found as a size of a step input with the same symbol."""
    sizes = {}  # symbol -> (input index, dim)
    for which, fake in fakes.items():
        if isinstance(fake, torch.Tensor):
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt):
                    sizes.setdefault(size.node.expr, (which, dim))
    slots = []
    for i, value in enumerate(flat):
        which = next((j for j, t in enumerate(step_inputs) if t is not None and value is t), None)
        if which is not None:
            slots.append((i, which, -1))
        elif isinstance(placeholders[i], torch.SymInt) and placeholders[i].node.expr in sizes:
            slots.append((i, *sizes[placeholders[i].node.expr]))
        elif not (isinstance(value, torch.Tensor) and id(value) in lasting):
            raise CaptureError(f"flat input {i} ({type(value).__name__}) is neither a step input, one of its "
                               "symbolic sizes nor a lasting tensor")
    return slots
