"""`vit-fast host`: the host work of a training step with the kernel launches stubbed, for vit_fast and timm eager
at the same shapes (vit_fast/tools/host_cost.py). Counts are checked; no time is asserted."""
from vit_fast.tools import host_cost


def test_host_meter_counts_launches_ops_and_reports_both_paths():
    results = host_cost.measure(["vit_fast", "timm_eager"], "vit_tiny_patch16_224", steps=2, warmup=1)
    fast, timm = results
    depth = 12
    assert fast.step_us > 0 and timm.step_us > 0
    # per block: attention, the MLP and two joins forward and backward (and no Triton launch in timm)
    assert fast.launches >= 6 * depth and timm.launches == 0
    assert fast.custom_ops >= 6 * depth and timm.custom_ops == 0 and timm.aten_calls > fast.aten_calls
    ops = {name: calls for name, calls, _ in fast.per_op}
    assert ops["vit_fast::attention_fwd"] == ops["vit_fast::attention_bwd"] == depth
    text = host_cost.format_report("vit_tiny_patch16_224", results)
    assert "vit_fast / timm eager host time:" in text and "not a GPU timing" in text
