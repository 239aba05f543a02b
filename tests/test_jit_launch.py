"""foscar.jit.launch on the CPU: a stand-in for a compiled kernel records when the DSL's argument conversion runs and
what each launch replays. A call converts its arguments once per distinct (stream, addresses, numbers); a repeat
replays the kept list; the oldest of more than ``BOUND_CALLS`` lists is dropped; a tensor the kernels cannot take
is refused before anything launches. (On the GPU every kernel test goes through it, and
tests/test_dequantize.py::test_replayed_launches_take_each_call_s_tables_lengths_and_stream checks replays there.)"""

import types

import cutlass
import pytest
import torch

from foscar import jit


class Compiled:
    """What ``launch`` uses of a compiled kernel: ``execution_args.generate_execution_args`` (here: records the
    converted arguments, returns a token) and ``run_compiled_program`` (records the token it replays)."""

    def __init__(self):
        self.converted, self.launched = [], []
        self.execution_args = types.SimpleNamespace(generate_execution_args=self._convert)

    def _convert(self, args, kwargs):
        self.converted.append(args)
        return (f"list {len(self.converted)}",), []

    def run_compiled_program(self, exe_args):
        self.launched.append(exe_args[0])


@pytest.fixture
def stream(monkeypatch):
    """torch's current stream, settable: ``stream.handle``."""
    current = types.SimpleNamespace(cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    return current


def test_a_repeated_call_replays_its_converted_arguments(stream):
    kernel, x, y = Compiled(), torch.zeros(64), torch.zeros(64)
    jit.launch(kernel, (x, cutlass.Float32), (3, cutlass.Int32), 5)
    jit.launch(kernel, (x, cutlass.Float32), (3, cutlass.Int32), 5)  # replayed
    jit.launch(kernel, (y, cutlass.Float32), (3, cutlass.Int32), 5)  # another address
    jit.launch(kernel, (x, cutlass.Float32), (4, cutlass.Int32), 5)  # another number
    stream.cuda_stream = 8
    jit.launch(kernel, (x, cutlass.Float32), (3, cutlass.Int32), 5)  # another stream
    assert kernel.launched == ["list 1", "list 1", "list 2", "list 3", "list 4"]
    pointer, number, plain, cu_stream = kernel.converted[0]
    assert pointer._pointer == x.data_ptr() and pointer._dtype is cutlass.Float32 and pointer._assumed_align == 16
    assert isinstance(number, cutlass.Int32) and number.value == 3 and plain == 5
    assert int(cu_stream) == 7 and int(kernel.converted[3][3]) == 8


def test_the_oldest_of_more_than_bound_calls_is_converted_again(stream, monkeypatch):
    monkeypatch.setattr(jit, "BOUND_CALLS", 3)
    kernel, x = Compiled(), torch.zeros(64)
    for n in (1, 2, 3, 1, 4, 2, 1):  # 1 used again before 4 comes, so 2 is the oldest when 4 arrives
        jit.launch(kernel, (x, cutlass.Float32), n)
    assert [args[1] for args in kernel.converted] == [1, 2, 3, 4, 2]
    assert len(jit._bound[id(kernel)][1]) == 3


def test_an_unaligned_tensor_is_refused_before_a_launch(stream):
    kernel, x = Compiled(), torch.zeros(64)
    with pytest.raises(ValueError, match=r"a \(63,\) tensor passed to a FOSCAR kernel is not 16-byte aligned"):
        jit.launch(kernel, (x[1:], cutlass.Float32), 1)
    assert kernel.launched == [] and kernel.converted == []
