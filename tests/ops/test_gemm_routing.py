"""The skinny-GEMM routing table on the CPU (F.linear is the only candidate there): measuring, the
JSON cache, routing, and the verify-cost curve."""

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltaspec.ops import gemm_routing
from deltaspec.ops.gemm_routing import ROW_BUCKETS, GemmRouter

SHAPES = {(16, 8): 3, (24, 40): 1}  # (N, K) -> weights of that shape per pass


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASPEC_CACHE_DIR", str(tmp_path))
    return tmp_path


def output_size_as_ms(fn, device):
    """A deterministic stand-in for the clock: 'milliseconds' = elements of the product."""
    return float(fn().numel())


def refuse_to_measure(fn, device):
    raise AssertionError("measured although the table was cached")


def test_table_saved_then_reloaded_without_measuring(cache_root, monkeypatch):
    first = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    assert first.measured
    files = list(cache_root.glob("gemm-routes_*.json"))
    assert files == [first.path]
    saved = json.loads(first.path.read_text())
    assert saved["device"] == "cpu" and saved["dtype"] == "float32" and saved["buckets"] == list(ROW_BUCKETS)
    assert set(saved["shapes"]) == {"16x8", "24x40"}
    assert saved["shapes"]["24x40"]["64"]["best"] == "torch"

    monkeypatch.setattr(gemm_routing, "time_ms", refuse_to_measure)
    second = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    assert not second.measured
    assert second.table == first.table


def test_only_missing_shapes_are_measured(cache_root, monkeypatch):
    GemmRouter({(16, 8): 1}, torch.float32, "cpu", show_progress=False)
    calls = []
    monkeypatch.setattr(gemm_routing, "time_ms", lambda fn, device: calls.append(1) or 1.0)
    router = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    assert router.measured and len(calls) == len(ROW_BUCKETS)
    assert set(json.loads(router.path.read_text())["shapes"]) == {"16x8", "24x40"}


def test_stale_table_is_measured_again(cache_root, monkeypatch):
    router = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    stale = json.loads(router.path.read_text())
    stale["candidates"] = ["torch", "a-kernel-that-no-longer-exists"]
    router.path.write_text(json.dumps(stale))
    assert GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False).measured


@pytest.mark.parametrize("rows", [1, 5, 64, 65])
def test_linear_matches_f_linear(cache_root, rows):
    router = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    torch.manual_seed(0)
    weight = torch.randn(24, 40)
    x = torch.randn(rows, 40)
    torch.testing.assert_close(router.linear(x, weight), F.linear(x, weight))
    batched = torch.randn(2, rows, 40)  # [batch, rows, K]
    torch.testing.assert_close(router.linear(batched, weight), F.linear(batched, weight))
    unknown = torch.randn(7, 40)  # a shape that was not measured
    torch.testing.assert_close(router.linear(x, unknown), F.linear(x, unknown))
    assert router.route((24, 40), rows) == "torch"


def test_relative_costs_interpolate_between_buckets(cache_root, monkeypatch):
    monkeypatch.setattr(gemm_routing, "time_ms", output_size_as_ms)
    router = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    per_row = 3 * 16 + 1 * 24  # multiplicity * N, summed over shapes
    assert router.pass_cost_ms(5) == pytest.approx(5 * per_row)
    costs = router.relative_costs(70)
    assert len(costs) == 70 and costs[0] == 1.0
    assert costs == pytest.approx(tuple(float(rows) for rows in range(1, 71)))


def test_relative_costs_of_real_timings(cache_root):
    costs = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False).relative_costs(16)
    assert len(costs) == 16 and costs[0] == 1.0 and all(cost > 0 for cost in costs)


def test_a_shipped_table_for_the_same_stack_skips_measuring(cache_root, tmp_path_factory, monkeypatch):
    measured = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    shipped = tmp_path_factory.mktemp("shipped")
    measured.path.rename(shipped / measured.path.name)  # the user's cache is now empty
    monkeypatch.setattr(gemm_routing, "SHIPPED_TABLES", shipped)
    monkeypatch.setattr(gemm_routing, "time_ms", refuse_to_measure)
    reused = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    assert not reused.measured and reused.table == measured.table


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_the_shipped_h200_table_covers_the_measured_shapes(shape):
    from deltaspec.engine.setup import ROUTED_WEIGHT_ELEMENTS
    from deltaspec.model.hybrid import HybridModel
    from deltaspec.model.shapes import shape_config
    from deltaspec.ops.dispatch import REFERENCE

    files = list(gemm_routing.SHIPPED_TABLES.glob("gemm-routes_NVIDIA-H200_*_bfloat16.json"))
    assert files
    table = json.loads(files[0].read_text())
    with torch.device("meta"):
        model = HybridModel(shape_config(shape), REFERENCE, torch.bfloat16, "meta", num_mtp_layers=1)
    model.fuse_projections()
    routed = {f"{n}x{k}" for (n, k) in model.linear_shapes() if n * k >= ROUTED_WEIGHT_ELEMENTS}
    assert routed <= set(table["shapes"]) and all(len(v) == len(ROW_BUCKETS) for v in table["shapes"].values())


def test_the_routed_shapes_leave_out_the_shared_expert_which_the_expert_kernels_multiply():
    from deltaspec.model.hybrid import HybridModel
    from deltaspec.model.shapes import shape_config
    from deltaspec.ops.dispatch import REFERENCE

    config = shape_config("qwen3.5-35b-a3b")
    with torch.device("meta"):
        model = HybridModel(config, REFERENCE, torch.bfloat16, "meta", num_mtp_layers=1)
    model.fuse_projections()
    width, hidden = config.moe.shared_expert_intermediate_size, config.hidden_size
    shapes = model.linear_shapes()
    assert (2 * width, hidden) not in shapes and (hidden, width) not in shapes
    assert shapes[(config.moe.num_experts + 1, hidden)] == config.num_hidden_layers + 1  # routers (MTP's too)


def test_a_moe_models_verify_costs_grow_with_the_experts_its_rows_read(cache_root, monkeypatch):
    from deltaspec.model.hybrid import HybridModel
    from deltaspec.model.shapes import shape_config
    from deltaspec.ops.dispatch import REFERENCE

    config = shape_config("qwen3.5-35b-a3b")
    with torch.device("meta"):
        model = HybridModel(config, REFERENCE, torch.bfloat16, "meta", num_mtp_layers=1).to(torch.bfloat16)
    moe = config.moe
    expert_bytes = 3 * moe.moe_intermediate_size * config.hidden_size * 2  # gate, up and down in bf16
    one_token = config.num_hidden_layers * (moe.num_experts_per_tok + 1) * expert_bytes  # the shared one too
    assert model.expected_expert_bytes(1) == pytest.approx(one_token)
    assert model.expected_expert_bytes(16) / expert_bytes / config.num_hidden_layers == pytest.approx(102.0 + 1, abs=1)

    monkeypatch.setattr(gemm_routing, "time_ms", output_size_as_ms)  # 1 ms per output value
    router = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    assert router.bytes_per_ms() == pytest.approx(24 * 40 * 4 / 24)  # the largest weight's bytes per ms
    dense = router.relative_costs(4)
    per_row = 3 * 16 + 1 * 24
    with_experts = router.relative_costs(4, lambda rows: 1000.0 * rows**2)
    extra = [1000.0 * rows**2 / router.bytes_per_ms() for rows in range(1, 5)]
    assert with_experts == pytest.approx([(r * per_row + extra[r - 1]) / (per_row + extra[0]) for r in range(1, 5)])
    assert with_experts[3] > dense[3]


def test_expected_distinct_experts_is_what_uniform_routings_select():
    from deltaspec.ops.moe import expected_distinct_experts

    assert expected_distinct_experts(1, 256, 8) == pytest.approx(8)
    assert expected_distinct_experts(4096, 256, 8) == pytest.approx(256)
    gen = torch.Generator().manual_seed(0)
    drawn = [torch.rand(16, 64, generator=gen).topk(4).indices.unique().numel() for _ in range(2000)]
    assert sum(drawn) / len(drawn) == pytest.approx(expected_distinct_experts(16, 64, 4), rel=0.01)


def fail_writing_the_table(monkeypatch):
    """The disk fills up when the table is written."""
    write_text = Path.write_text

    def full(path, *args, **kwargs):
        if path.name.endswith(".json.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)


def cache_under_a_file(monkeypatch, tmp_path):
    """The cache directory's parent is a regular file (as a read-only cache, mkdir fails, even for root)."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DELTASPEC_CACHE_DIR", str(tmp_path / "a-file" / "cache"))


@pytest.mark.parametrize(
    ("break_cache", "reason"),
    [(fail_writing_the_table, "No space left on device"), (cache_under_a_file, "Not a directory")],
    ids=["full", "not a directory"],
)
def test_a_cache_that_cannot_be_written_costs_only_the_saving(cache_root, monkeypatch, caplog, break_cache, reason):
    if break_cache is cache_under_a_file:
        break_cache(monkeypatch, cache_root)
    else:
        break_cache(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="deltaspec.ops"):
        router = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)  # the engine's start: no raise
    [warning] = [r.getMessage() for r in caplog.records if r.name == "deltaspec.ops"]
    assert warning.startswith(f"Cannot save the GEMM routing table to {router.path} ({reason}); this run uses")
    assert router.measured and set(router.table) == set(SHAPES)
    weight, x = torch.randn(24, 40), torch.randn(3, 40)
    torch.testing.assert_close(router.linear(x, weight), F.linear(x, weight))
    assert not list(cache_root.rglob("*.json*"))  # nothing half-written left behind
    assert GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False).measured  # measured again next time


def test_an_unreadable_cached_table_is_measured_again(cache_root, monkeypatch, caplog):
    first = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    read_text = Path.read_text

    def failing_disk(path, *args, **kwargs):
        if path == first.path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", failing_disk)
    with caplog.at_level(logging.WARNING, logger="deltaspec.ops"):
        again = GemmRouter(SHAPES, torch.float32, "cpu", show_progress=False)
    assert again.measured and set(again.table) == set(SHAPES)
    warnings = [r.getMessage() for r in caplog.records if r.name == "deltaspec.ops"]
    assert warnings == [f"Cannot read the GEMM routing table {first.path} (Input/output error); it is measured again."]
