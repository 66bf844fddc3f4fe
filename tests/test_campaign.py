"""`vit-fast bench --campaign --out DIR` end to end on CPU with --dry-run (tiny shapes, kernels in the Triton
interpreter, torch.compile with the eager backend), so the command is known to work before a GPU sees it."""
import csv
import json

import pytest
import torch

from vit_fast.tools import bench, campaign

TAGS = ("gpu", "driver", "torch", "triton", "cuda", "git")


@pytest.mark.slow
def test_dry_run_writes_every_file_and_stage(tmp_path, monkeypatch, capsys):
    # the hook for more stages: one registered after tune is budgeted, timed and reported
    monkeypatch.setattr(campaign, "STAGES", list(campaign.STAGES))

    def extra(c):
        c.results["extra"] = [c.tagged(dict(kernel="layer_norm", config="BLOCK=1024"))]
        return dict(status="ok", rows=1)

    campaign.register_stage(campaign.Stage("extra", extra, budget_s=5), after="tune")
    with pytest.raises(ValueError, match="exists"):
        campaign.register_stage(campaign.Stage("extra", extra, budget_s=5))

    out = tmp_path / "camp"
    # budgets 5x (the dry run checks the command, not its timing: a loaded 2-core CI machine ran out of the profile's)
    assert bench.main(["--campaign", "--dry-run", "--budget", "3000", "--out", str(out)]) == 0
    log = capsys.readouterr().out
    stages = [s.name for s in campaign.STAGES]
    assert stages == ["env", "headline", "profile", "micro", "tune", "extra", "check", "tests", "throughput"]
    for name in stages:  # a progress line when each stage starts and ends
        assert f"] {name}: start" in log and f"] {name}: ok in" in log, log

    result = json.loads((out / "campaign.json").read_text())
    assert all(result["stages"][s]["status"] == "ok" for s in stages), result["stages"]
    assert result["meta"]["dry_run"] is True and result["peaks"]["gemm_bf16_tflops"] > 0
    assert result["stages"]["tests"]["passed"] >= 1 and result["stages"]["tests"]["failed"] == 0
    assert result["stages"]["check"]["passed"] == result["stages"]["check"]["rows"] > 0

    def rows(name):
        with open(out / f"{name}.csv", newline="") as f:
            found = list(csv.DictReader(f))
        assert found and all(r[t] for r in found for t in TAGS), name
        return found

    micro = rows("micro")
    ops = {r["op"] for r in micro}
    assert {"layer_norm", "add_layer_norm", "bias_gelu", "attention", "attention_linear", "linear_act",
            "patch_embed"} <= ops
    assert {r["pass_"] for r in micro} == {"fwd", "fwd+bwd"}
    for r in micro:  # every provider timed: the fused kernel, the eager ops and their torch.compile
        assert all(float(r[f"{p}_ms"]) > 0 for p in ("vit_fast", "eager", "eager_compiled", "vit_fast_kernel",
                                                      "eager_kernel")), r
    throughput = rows("throughput")
    assert {r["path"] for r in throughput} == {p for p in campaign.THROUGHPUT_PATHS if not p.endswith("graph")}
    assert all(float(r["images_per_s"]) > 0 and not r.get("error") for r in throughput), throughput
    assert rows("extra")[0]["config"] == "BLOCK=1024"
    tune = rows("tune")  # on CPU nothing is timed: every fusion and kernel keeps its static first choice
    assert {r["op"] for r in tune if r["kind"] == "fusion"} >= {"patch_embed", "attention", "mlp", "join"}
    rows("check")
    rows("tests")
    profile = rows("profile")  # kernel time per op family, one process per path
    assert {r["path"] for r in profile} == set(campaign.PROFILE_PATHS) and {r["family"] for r in profile}
    assert all(float(r["kernel_ms_per_step"]) >= 0 and float(r["step_ms"]) > 0 for r in profile)
    kernels = rows("profile_kernels")  # each path's slowest kernels by name, ranked
    assert {r["path"] for r in kernels} == set(campaign.PROFILE_PATHS)
    for path in campaign.PROFILE_PATHS:
        mine = [r for r in kernels if r["path"] == path]
        assert [int(r["rank"]) for r in mine] == list(range(1, len(mine) + 1))
        assert len(mine) <= campaign.PROFILE_TOP_KERNELS and all(r["kernel"] and r["family"] for r in mine)
        times = [float(r["kernel_ms_per_step"]) for r in mine]
        assert times == sorted(times, reverse=True)
    for png in ("throughput.png", "micro.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary and "vit_fast / timm eager" in summary and "x compiled" in summary
    assert "Kernel time per op family" in summary and "Slowest kernels per path" in summary
    assert "| tune | ok |" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message")
def test_without_cuda_one_line_and_exit_0(tmp_path, capsys):
    assert bench.main(["--campaign", "--out", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.strip() == campaign.NO_CUDA
    assert not (tmp_path / "none").exists()


def test_budget_scales_every_stage(tmp_path, monkeypatch, capsys):
    """--budget splits the total over the stages in proportion; a stage that breaks is reported, the rest run."""
    seen = []

    def record(c):
        seen.append(round(c.left()))
        return dict(status="ok")

    def broken(c):
        raise RuntimeError("boom")

    monkeypatch.setattr(campaign, "STAGES", [campaign.Stage("a", record, 270), campaign.Stage("b", broken, 270),
                                             campaign.Stage("c", record, 0)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--campaign", "--dry-run", "--budget", "54", "--out", str(tmp_path)]) == 1
    assert seen == [27, 0]
    log = capsys.readouterr().out
    assert "b: error" in log and "RuntimeError: boom" in log and "FAILED stages: b" in log
    assert (tmp_path / "summary.md").exists()


@pytest.mark.slow
def test_a_hanging_path_loses_only_its_own_row_and_leaves_its_stack(tmp_path, monkeypatch, capsys):
    """--stages headline micro --dry-run with vit_fast_compile and the bias_gelu micro case sleeping past their
    timeouts: every other row and case is measured and on disk, the hung row is an error row, hangs.log holds both
    stacks (faulthandler), the summary names them."""
    monkeypatch.setenv(campaign.SIMULATE_HANG, "vit_fast_compile,micro:bias_gelu")
    # each hang costs its whole timeout: short ones, still several times what a compile row (eager backend) or a
    # micro case takes on a loaded 2-core machine
    monkeypatch.setitem(campaign.ROW_TIMEOUT_S, "compile", 15.0)
    monkeypatch.setattr(campaign, "MICRO_CASE_TIMEOUT_S", 20.0)
    budgets = dict(env=15, headline=210, micro=200)
    monkeypatch.setattr(campaign, "STAGES", [campaign.Stage(s.name, s.run, budgets.get(s.name, s.budget_s))
                                             for s in campaign.STAGES])
    out = tmp_path / "quick"
    assert bench.main(["--campaign", "--stages", "headline", "micro", "--dry-run", "--out", str(out),
                       "--budget", str(sum(s.budget_s for s in campaign.STAGES if s.name in budgets))]) == 0
    log = capsys.readouterr().out
    assert "] env: start" in log and "] headline: start" in log and "] micro: start" in log
    assert "] profile: start" not in log and "] tests: start" not in log
    with open(out / "micro.csv", newline="") as f:
        ops = {r["op"] for r in csv.DictReader(f)}
    assert "bias_gelu" not in ops and {"layer_norm", "attention", "patch_embed"} <= ops  # cases after it ran
    with open(out / "throughput.csv", newline="") as f:
        rows = {r["path"]: r for r in csv.DictReader(f)}
    eager_paths = ("timm_eager", "vit_fast", "timm_compile")  # the headline's paths (no graph on CPU)
    assert set(rows) == {*eager_paths, "vit_fast_compile"}
    assert "timed out" in rows["vit_fast_compile"]["error"]
    assert all(float(rows[p]["images_per_s"]) > 0 for p in eager_paths)
    hangs = (out / "hangs.log").read_text()
    assert "vit_fast_compile" in hangs and "throughput_child" in hangs and "most recent call first" in hangs
    assert "micro B/16 bias_gelu" in hangs and "micro_child" in hangs
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary and "timed out" in summary


def test_record_is_written_under_docs_measured(tmp_path, monkeypatch):
    """A real (not dry) campaign leaves docs/measured/<gpu>-<date>.md and its CSVs, ready to commit."""
    (tmp_path / "docs" / "measured").mkdir(parents=True)
    monkeypatch.setattr(campaign, "REPO", str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    c = campaign.Campaign(out=str(out), dry_run=False, device="cpu")
    c.meta = dict(gpu="NVIDIA H200", date="2026-11-26 07:00 UTC", driver="x", torch="t", triton="t", cuda="c", git="g")
    c.results["throughput"] = [dict(c.meta, model="vit_base_patch16_224", dtype="bf16", batch=256, path="timm_eager",
                                    images_per_s=2719.0, step_ms=94.1, p10_ms=93.5, p90_ms=97.6, mfu=0.3,
                                    peak_mem_gb=18.1)]
    written = campaign.write_outputs(c)
    assert "docs/measured/nvidia-h200-2026-11-26-0700.md" in written
    record = (tmp_path / "docs" / "measured" / "nvidia-h200-2026-11-26-0700.md").read_text()
    assert "NVIDIA H200" in record and "2719" in record and "DRY RUN" not in record
    assert (tmp_path / "docs" / "measured" / "nvidia-h200-2026-11-26-0700" / "throughput.csv").exists()
    assert not (tmp_path / "vit_fast").exists()  # no profile: nothing for the calibrated model


def test_record_with_a_profile_is_shipped_as_calibration_data(tmp_path, monkeypatch):
    """With profile rows, the record also lands in vit_fast/data/measured/ in the calibrated model's form; a
    CUDA-graph step stands for its path's GPU time."""
    import json

    from vit_fast.tools import calibration

    (tmp_path / "docs" / "measured").mkdir(parents=True)
    monkeypatch.setattr(campaign, "REPO", str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    c = campaign.Campaign(out=str(out), dry_run=False, device="cpu")
    c.meta = dict(gpu="NVIDIA H100 80GB HBM3", date="2026-12-01 07:00 UTC", driver="x", torch="2.11.0", triton="3.6.0",
                  cuda="13.0", git="abc1234")
    c.peaks = dict(gemm_bf16_tflops=760.0, copy_gbps=3000.0)
    row = dict(c.meta, model="vit_base_patch16_224", batch=256, dtype="bf16")
    c.results["throughput"] = [dict(row, path="vit_fast", step_ms=80.0, p10_ms=79.0, p90_ms=81.0, images_per_s=3200.0,
                                    mfu=0.4, peak_mem_gb=18.0),
                               dict(row, path="vit_fast_graph", step_ms=78.0, p10_ms=77.0, p90_ms=79.0,
                                    images_per_s=3282.0, mfu=0.41, peak_mem_gb=18.0),
                               dict(row, path="timm_compile", error="hung")]
    c.results["profile"] = [dict(row, path="vit_fast", family=f, kernel_ms_per_step=ms, launches_per_step=n,
                                 step_ms=79.0) for f, ms, n in (("GEMM", 45.0, 192), ("attention", 9.0, 26))]
    campaign.write_outputs(c)
    shipped = tmp_path / "vit_fast" / "data" / "measured" / "nvidia-h100-80gb-hbm3-2026-12-01-0700.json"
    doc = json.loads(shipped.read_text())
    m = calibration.Measurement.from_json("h100", doc)
    assert m.gpu_kind == "H100" and m.copy_tb_per_s == 3.0 and m.dense_peak_tflops == 989.0
    assert "torch 2.11.0" in m.source and "abc1234" in m.source
    assert m.profile["vit_base_patch16_224"]["vit_fast"]["families"] == {"GEMM": 45.0, "attention": 9.0}
    assert m.steps["vit_base_patch16_224"] == {"vit_fast": dict(ms=78.0, how=m.steps["vit_base_patch16_224"]
                                                                ["vit_fast"]["how"])}
    assert "vit_fast_graph" in m.steps["vit_base_patch16_224"]["vit_fast"]["how"]


def test_quick_runs_the_headline_and_its_profile_in_five_minutes_and_stages_run_alone(capsys):
    quick = campaign._stages(True, None)
    assert [s.name for s in quick] == ["env", "headline", "profile"] and sum(s.budget_s for s in quick) <= 300
    assert [s.name for s in campaign._stages(False, ["micro"])] == ["env", "micro"]  # env tags every row
    assert [s.name for s in campaign._stages(True, ["tests", "micro"])] == ["env", "micro", "tests"]
    assert campaign._stages(False, None) == campaign.STAGES
    with pytest.raises(ValueError, match="unknown stage.*nope.*expected some of env"):
        campaign._stages(False, ["micro", "nope"])


def test_a_record_lists_the_files_it_holds(tmp_path, monkeypatch):
    """docs/measured/<gpu>-<date>-<hhmm>.md names exactly the files copied beside it (the CSVs, logs, check.txt and
    campaign.json; not the PNGs), and the summary names what the output folder holds."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("campaign.json", "throughput.csv", "tests.log", "check.txt", "throughput.png", "summary.md"):
        (out / name).write_text("x")
    monkeypatch.setattr(campaign, "REPO", str(tmp_path / "repo"))
    c = campaign.Campaign(out=str(out), dry_run=False, meta=dict(gpu="NVIDIA H200", date="2026-11-28 10:05 UTC"))
    assert "Files: campaign.json (everything), check.txt, tests.log, throughput.csv, throughput.png" in \
        campaign.summary(c)
    record = tmp_path / "repo" / campaign.write_record(c)
    assert record.name == "nvidia-h200-2026-11-28-1005.md"
    assert record.read_text().endswith("Files (in nvidia-h200-2026-11-28-1005/): campaign.json (everything), "
                                       "check.txt, tests.log, throughput.csv\n")
    assert sorted(p.name for p in record.with_suffix("").iterdir()) == ["campaign.json", "check.txt", "tests.log",
                                                                        "throughput.csv"]


def test_the_throughput_stage_measures_the_cases_it_is_given(tmp_path, capsys, monkeypatch):
    """`--stages throughput --paths ... --batches ...`: the stage's cases from the command line (the GPU session's
    batch-64 rows of issue 30); the dry run keeps its tiny model and batch but the paths given. The rows share a
    process; one failing after another row in it is measured again in a new process, where it succeeds."""
    monkeypatch.setenv(campaign.SIMULATE_FAILURE, "vit_fast")
    parser = bench.build_parser()
    args = parser.parse_args(["--campaign", "--stages", "throughput", "--models", "vit_small_patch16_224",
                              "--batches", "64", "--paths", "timm_compile", "vit_fast_compile", "--out", "x"])
    assert (args.models, args.batches, args.paths) == (["vit_small_patch16_224"], [64], ["timm_compile",
                                                                                        "vit_fast_compile"])
    assert campaign.THROUGHPUT_BATCHES == [64, 256]
    out = tmp_path / "b64"
    assert bench.main(["--campaign", "--stages", "throughput", "--dry-run", "--paths", "timm_eager", "vit_fast",
                       "--budget", "600", "--out", str(out)]) == 0
    with open(out / "throughput.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["path"] for r in rows) == ["timm_eager", "vit_fast"]
    assert all(float(r["images_per_s"]) > 0 and not r.get("error") for r in rows)
    assert "vit_fast: failed after other items in one process; again in a new one" in capsys.readouterr().out
    # a child that dies before its first item (imports, the CUDA context): that row is an error row with the
    # reason, the next goes on in a new process; nothing reads as skipped by the budget
    monkeypatch.setenv(campaign.SIMULATE_FAILURE, "start")
    out = tmp_path / "start"
    assert bench.main(["--campaign", "--stages", "throughput", "--dry-run", "--paths", "timm_eager", "vit_fast",
                       "--budget", "600", "--out", str(out)]) == 0
    with open(out / "throughput.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == ["timm_eager", "vit_fast"]
    assert all("before its first item: RuntimeError: simulated failure" in r["error"] for r in rows)
    assert json.loads((out / "campaign.json").read_text())["stages"]["throughput"]["skipped"] == 0
