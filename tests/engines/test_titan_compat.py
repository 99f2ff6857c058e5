"""The TorchTitan compatibility layer: every patch applies, and every patch is still needed.

One test per patch. A test fails when the patch stops applying (an upstream
rename moved what it patches) or when it stops being needed (an upgrade fixed
the gap): either way the patch needs a look. No training here (that is
test_titan_train.py); these run in-process in a few seconds.
"""

from __future__ import annotations

import pytest

from ptops.recipes.titan import compat


@pytest.fixture(scope="module", autouse=True)
def applied():
    names = compat.apply()
    # the layer is applied before torchtitan's trainer is imported; importing it must now work
    import torchtitan.trainer  # noqa: F401

    return names


def _check(name: str) -> None:
    patch = next(p for p in compat.PATCHES if p.name == name)
    assert patch.applied(), (
        f"compat patch {name} did not apply (did torchtitan/torch move what it patches?)"
    )
    assert patch.needed(), (
        f"compat patch {name} is no longer needed with the installed torch/torchtitan: remove it "
        "from "
        "ptops/recipes/titan/compat.py"
    )


def test_apply_is_idempotent(applied):
    assert applied == [p.name for p in compat.PATCHES]
    assert compat.apply() == applied


def test_stub_minimal_async_ep_kernels():
    _check("stub_minimal_async_ep_kernels")
    import sys

    from torchtitan.distributed.minimal_async_ep import api  # imports the kernels module

    kernels = sys.modules[compat._KERNELS]
    assert api.copy_rows_to_peers_kernel is kernels.copy_rows_to_peers_kernel
    with pytest.raises(RuntimeError, match="Triton is not available"):
        kernels.copy_rows_to_peers_kernel()


def test_point_device_at_cpu():
    _check("point_device_at_cpu")
    import torch
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    assert (
        utils.device_type == "cpu"
        and dist_utils.device_type == "cpu"
        and metrics.device_type == "cpu"
    )
    assert utils.get_local_device() == torch.device("cpu")
    dm = utils.device_module
    dm.set_device(torch.device("cpu"))
    dm.synchronize()
    assert dm.current_device() == 0
    assert dm.memory_stats()["reserved_bytes.all.peak"] > 0
    assert dm.get_device_properties().total_memory > 0


def test_force_sum_reduction_on_gloo():
    _check("force_sum_reduction_on_gloo")


def test_add_distributed_set_timeout():
    _check("add_distributed_set_timeout")


def test_pp_step_accepts_microbatches():
    _check("pp_step_accepts_microbatches")
    import inspect

    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    # every schedule torchtitan may pick inherits the wrapped step
    for cls in (Schedule1F1B, ScheduleInterleaved1F1B):
        assert getattr(cls.step, compat._MARK, False), cls
        assert "target" in inspect.signature(cls.step.__wrapped__).parameters


def test_chat_template_generation_tags():
    _check("chat_template_generation_tags")
    import types

    from torchtitan.components.tokenizer import BaseTokenizer

    tok = types.SimpleNamespace()
    BaseTokenizer.set_chat_template(
        tok,
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
    )
    assert tok._chat_template.render(messages=[{"content": "hi"}]) == "hi"


def test_sdpa_instead_of_flex():
    from torchtitan.models.common.attention import FlexAttention

    from ptops.recipes.titan.registry import tiny_llama3

    spec = tiny_llama3(dim=32, n_layers=1, n_heads=2, vocab_size=128, seq_len=16)
    assert compat.sdpa_instead_of_flex_applied(spec.model), "model config still uses FlexAttention"
    assert not list(spec.model.traverse(FlexAttention.Config, recurse=True))
    assert compat.sdpa_instead_of_flex_needed(), (
        "FlexAttention now has a CPU backward: SDPA swap can go"
    )
