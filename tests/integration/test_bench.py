"""`vpipe bench` runs benchmark scripts by name and records what
happened; `vpipe_lab.report` renders their JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vpipe_lab import bench, report
from vpipe_lab.cli import main as cli_main

SCRIPT = '''
import argparse, json, sys
p = argparse.ArgumentParser()
p.add_argument("--json")
p.add_argument("--fail", action="store_true")
a = p.parse_args()
print("table of fake results")
if a.fail:
    sys.exit(3)
json.dump({"benchmark": "fake", "value": 42}, open(a.json, "w"))
'''


@pytest.fixture
def fake_benchmarks(tmp_path, monkeypatch):
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "fake.py").write_text(SCRIPT)
    monkeypatch.setattr(bench, "default_benchmarks_dir", lambda: scripts)
    monkeypatch.setattr(bench, "BENCHMARKS", {
        "fake": bench.Benchmark("fake", "fake.py", "a fake"),
        "broken": bench.Benchmark("broken", "fake.py", "always fails", ("--fail",)),
        "absent": bench.Benchmark("absent", "absent.py", "not written yet"),
    })
    return tmp_path


def test_every_named_benchmark_of_the_issue_is_registered():
    assert {"throughput", "microbatch", "planner", "simulator", "migration", "nas",
            "soak"} <= set(bench.BENCHMARKS)
    for b in bench.BENCHMARKS.values():
        if b.name not in ("nas", "soak"):  # written on other branches
            assert b.script_in(bench.default_benchmarks_dir()).exists(), b.script


def test_all_benchmarks_write_json_and_a_status_file(fake_benchmarks, capfd):
    out = fake_benchmarks / "results"
    assert cli_main(["bench", "--json", str(out)]) == 1  # one failed
    assert json.loads((out / "fake.json").read_text()) == {"benchmark": "fake", "value": 42}
    status = {r["name"]: r for r in json.loads((out / "bench.json").read_text())["benchmarks"]}
    assert status["fake"]["status"] == "ok"
    assert status["broken"] == {**status["broken"], "status": "failed", "reason": "exit status 3"}
    assert status["absent"]["status"] == "skipped"
    assert f"absent.py is not in {fake_benchmarks / 'benchmarks'}" in status["absent"]["reason"]
    assert "table of fake results" in capfd.readouterr().out


def test_bench_without_a_checkout_says_in_one_line_what_it_needs(tmp_path, monkeypatch, capsys):
    # an installed vpipe: no benchmarks/
    monkeypatch.setattr(bench, "SOURCE_ROOT", tmp_path / "site-packages")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["bench", "planner"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vpipe: error: vpipe bench runs the scripts of a vpipe source checkout's benchmarks/ folder, and "
        f"{tmp_path / 'benchmarks'} is not one: run it from the checkout or pass --benchmarks DIR")


def test_one_benchmark_to_one_json_file(fake_benchmarks):
    target = fake_benchmarks / "fake-out.json"
    assert cli_main(["bench", "fake", "--json", str(target)]) == 0
    assert json.loads(target.read_text())["value"] == 42
    assert not (fake_benchmarks / "bench.json").exists()


def test_unknown_benchmark_is_a_clear_error(fake_benchmarks, capsys):
    assert cli_main(["bench", "nope"]) == 2
    assert "unknown benchmark nope; choose from fake, broken, absent" in capsys.readouterr().err


THROUGHPUT = {"cases": [{"model": "transformer", "stages": 2, "budget_bytes": 5 << 20, "global_batch": 32,
                         "partition": [3, 3], "ideal_samples_per_s": 600.0, "rows": [
    {"system": "GPipe (all R)", "vpipe": False, "samples_per_s": 150.0, "of_ideal": 0.25,
     "micro_batch_size": 8,
     "micro_batches": 4, "vs_gpipe": None, "vs_without_vpipe": None},
    {"system": "1F1B + vpipe", "vpipe": True, "samples_per_s": 180.0, "of_ideal": 0.30, "micro_batch_size": 8,
     "micro_batches": 4, "vs_gpipe": {"median": 1.2, "min": 1.1, "max": 1.3}, "vs_without_vpipe": None},
    {"system": "1F1B, no budget (all D)", "vpipe": False, "samples_per_s": 300.0, "of_ideal": 0.5,
     "micro_batch_size": 8, "micro_batches": 4, "vs_gpipe": None, "vs_without_vpipe": None},
    {"system": "PipeDream (all D)", "fits": False, "samples_per_s": None}]}]}


def test_headline_compares_vpipe_with_the_best_baseline_under_the_budget():
    rows = report.headline_rows({"throughput": THROUGHPUT})
    # the no-budget row is a reference, not a baseline under the same budget
    assert rows == [["throughput, transformer on 2 CPU stages, same memory budget",
                     "1F1B + vpipe: 180 samples/s (30% of ideal)", "GPipe (all R): 150 samples/s (25%)",
                     "1.20x"]]


def test_readme_headline_is_rewritten_between_its_markers_only(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "throughput.json").write_text(json.dumps(THROUGHPUT))
    readme = tmp_path / "README.md"
    readme.write_text("# x\nintro\n<!-- headline:start -->\nold numbers\n<!-- headline:end -->\nrest\n")
    assert report.main([str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\nintro\n<!-- headline:start -->\n| result |") and text.endswith(
        "<!-- headline:end -->\nrest\n")
    assert "old numbers" not in text and "1.20x" in text
    assert report.main([str(results), "--readme", str(readme)]) == 0
    assert readme.read_text() == text  # regenerating is stable


def test_missing_markers_or_results_are_clear_errors(tmp_path, capsys):
    (tmp_path / "README.md").write_text("no markers\n")
    assert report.main([str(tmp_path), "--readme", str(tmp_path / "README.md")]) == 2
    assert "markers <!-- headline:start --> ... <!-- headline:end --> not found" in capsys.readouterr().err
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "run `vpipe bench --json" in capsys.readouterr().err


def test_docs_tables_cover_every_benchmark_and_say_what_is_missing(tmp_path):
    text = report.results_markdown({"throughput": THROUGHPUT})
    assert "| PipeDream (all D) | - | does not fit |" in text
    assert "_No `planner.json`: run `vpipe bench planner`._" in text


def test_plots_are_png_files(tmp_path):
    pytest.importorskip("matplotlib")
    written = report.plot({"throughput": THROUGHPUT}, tmp_path)
    assert [p.name for p in written] == ["throughput.png"]
    assert Path(written[0]).read_bytes()[:4] == b"\x89PNG"


def test_gpu_swap_results_give_a_headline_row(tmp_path):
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "swap.json").write_text(json.dumps({
        "device": "cuda (NVIDIA H100 80GB HBM3)", "overlap": {"overlap": 0.97},
        "bandwidth": [{"size": 64 << 20, "way": "d2h pool (copy engine)", "gb_per_s": 50.9},
                      {"size": 64 << 20, "way": "d2h pageable (.cpu())", "gb_per_s": 1.2}]}))
    rows = report.headline_rows(report.load_results(tmp_path))
    assert rows == [["GPU swap-out of 64 MiB (NVIDIA H100 80GB HBM3)",
                     "pinned pool: 50.9 GB/s, 97% hidden under compute", "`.cpu()`: 1.2 GB/s", "42x"]]


def test_nas_memory_and_soak_results_get_tables():
    phase = {"before": 100.0, "transition": 40.0, "after": 45.0}
    nas = {"config": {"blocks": 4, "added": 8, "add_step": 6, "steps": 42, "optimal_partition": [7, 7]},
           "per_round": [{"throughput": {"static": phase, "vpipe": {**phase, "after": 57.0},
                                         "optimal": {"steady": 58.0}},
                          "recovery_steps": 12, "static_recovery_steps": None},
                         {"throughput": {"static": phase, "vpipe": {**phase, "after": 57.0},
                                         "optimal": {"steady": 58.0}},
                          "recovery_steps": None, "static_recovery_steps": None}],
           "vpipe_over_static_after": {"median": 1.27, "min": 1.2, "max": 1.3},
           "vpipe_over_optimal_after": {"median": 0.98, "min": 0.98, "max": 0.98},
           "static_over_optimal_after": {"median": 0.78, "min": 0.78, "max": 0.78}}
    memory = {"budget_bytes": 18 << 20, "model": {"micro_batch_size": 8},
              "samples_per_s": {"gpipe_recompute": 100.0, "vpipe": 126.0},
              "footprint_bytes": {"1f1b_kept": [25 << 20, 16 << 20], "gpipe_recompute": [9 << 20, 9 << 20],
                                  "vpipe": [14 << 20, 14 << 20]},
              "within_budget": {"1f1b_kept": False, "gpipe_recompute": True, "vpipe": True},
              "vpipe_policies": [{"0": "D", "1": "S"}, {"2": "R"}],
              "vpipe_over_recompute": {"median": 1.26, "min": 1.2, "max": 1.3}}
    rank = {"rank": 0, "plans_applied": 399, "rss_first_bytes": 300 << 20, "rss_mid_bytes": 310 << 20,
            "rss_end_bytes": 311 << 20, "rss_growth_second_half": 0.0032, "pool_peak_bytes": 138 << 10,
            "pool_used_end_bytes": 0}
    soak = {"steps": 2000, "move_every": 5, "forced_plans": 399, "ranks": [rank],
            "params_equal_reference": True,
            "rss_target": 0.02}
    text = report.results_markdown({"nas": nas, "memory": memory, "soak": soak})
    assert "| static | 100.0 | 40.0 | 45.0 | 0.78x (0.78-0.78) | never |" in text
    assert "| vpipe | 100.0 | 40.0 | 57.0 | 0.98x (0.98-0.98) | 12 steps, never |" in text
    assert "| 1f1b_kept | not run (over budget) | 25.0, 16.0 | no |" in text
    assert "0:D 1:S / 2:R" in text
    assert "| 0 | 399 | 300.0 | 310.0 | 311.0 | +0.32% | 138 | 0 |" in text
    assert "bit for bit: yes" in text


def test_shapes_results_get_a_table_and_a_headline_row_with_the_worst_ratio():
    row = {"shape": "tutorial", "balanced_step_s": 0.192, "uneven_step_s": 0.211, "vpipe_step_s": 0.195,
           "vpipe_over_balanced": 1.02, "ratio_range": [1.0, 1.04], "uneven_over_balanced": 1.1,
           "moved": True,
           "final_partition": [4, 4], "moved_at_step": 23}
    other = {**row, "shape": "hf_gpt2", "vpipe_step_s": 0.187, "balanced_step_s": 0.187,
             "vpipe_over_balanced": 1.0,
             "moved": False, "final_partition": [6, 2]}
    shapes = {"steps": 44, "measure_steps": 14, "rounds": 2, "rows": [row, other],
              "skipped": {"sequential": "not asked"}}
    text = report.results_markdown({"shapes": shapes})
    assert "| tutorial | 192 | 211 | 195 | 1.02x (1.00-1.04) | 1.10x | 4,4 at step 23 |" in text
    assert "| hf_gpt2 | 187 | 211 | 187 | 1.00x (1.00-1.04) | 1.10x | 6,2 (none) |" in text
    assert "sequential skipped: not asked." in text
    assert report.headline_rows({"shapes": shapes}) == [[
        "the one line on users' trainers (tutorial, hf_gpt2), 6,2 split on 2 stages",
        "+ vpipe: 195, 187 ms/step", "hand-balanced 4,4: 192, 187 ms/step", "1.02x at worst"]]


def test_overhead_results_get_a_table_and_a_headline_row_per_size():
    row = {"size": "small", "steps": 160, "plain_step_s": 0.0131, "attached_step_s": 0.0133,
           "attached_over_plain": 1.012, "attached_range": [0.99, 1.03], "planned_step_s": 0.0134,
           "planned_over_plain": 1.021, "planned_range": [1.0, 1.04], "plans_applied": 0,
           "planner_cpu_share": 0.024, "same_losses": True}
    breakdown = {"steps": 160, "ranks": [{"rank": 0, "step_s": 0.0138, "per_step_s": {
        "step": 127e-6, "micro-batch": 142e-6, "layer call": 123e-6, "saved tensor": 183e-6},
        "calls_per_step": {"micro-batch": 8, "layer call": 16, "saved tensor": 16}}]}
    overhead = {"rounds": 3, "rows": [row], "breakdown": breakdown}
    text = report.results_markdown({"overhead": overhead})
    assert ("| small | 160 | 13.1 | 13.3 | 1.012x (0.990-1.030) | 13.4 | 1.021x "
            "(1.000-1.040) | 2.4% | 0 | yes |"
            in text)
    assert "| 0 | 13.8 | 127 | 142 (8 calls) | 123 (16 calls) | 183 (16 calls) |" in text
    assert report.headline_rows({"overhead": overhead}) == [[
        "attaching to a balanced 2-stage pipeline that fits, small model (13 ms steps)",
        "attached: 1.012x plain, planner on: 1.021x (0 plans applied)", "plain: 13.1 ms/step",
        "1.021x at worst (0.99-1.04)"]]


def test_planner_headline_shows_the_worst_gap_over_every_size():
    def row(graph, nodes, stages, gap, seconds):
        return {"graph": graph, "nodes": nodes, "stages": stages, "kl_gap": gap, "kl_s_median": seconds,
                "exact_s": 1.0, "nx_s": 2.0, "nx_valid": False, "nx_gap": 0.12}
    planner = {"rows": [row("gnmt", 163, 4, 0.0, 0.002), row("amoebanet", 4481, 64, 0.003, 0.05),
                        row("amoebanet", 4481, 128, 0.001, 0.08)]}
    assert report.headline_rows({"planner": planner}) == [[
        "planner, paper graphs (163-4481 nodes) on 4-128 stages",
        "worst gap to optimum +0.30% (amoebanet, 64 stages); slowest plan 80 ms (amoebanet, 128 stages)",
        "networkx KL, amoebanet on 128 stages: 2000 ms, gap +12%, not a valid pipeline", "25.0x faster"]]


def _benchmark(name: str):
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _throughput_bench():
    return _benchmark("throughput_bench")


def test_the_gpu_timeline_reads_idle_time_copies_and_phases_off_the_devices_clock(tmp_path, monkeypatch):
    """A trace as torch's profiler writes it: the host issues the forwards by 100 us, the
    device runs them until 310 us; a gap, then the backward's kernel until 950 us; a
    swap-out from 160 to 460 us, 160 us of it under kernels."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # (the script puts benchmarks/ on it)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # (its import sets one for the GPU runs)
    timeline = _benchmark("gpu_timeline")
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "bench.step", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "bench.forward", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 2,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150, "dur": 2,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 300,
         "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 450, "dur": 500,
         "args": {"stream": 7, "correlation": 2}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 160, "dur": 300,
         "args": {"stream": 20, "bytes": 4096}},
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    row = timeline.summarize(timeline.read_trace(str(tmp_path / "trace.json")), step_s=0.001)
    # the device's end of the forwards: 310 us
    assert (row["forward_ms"], row["idle_forward_ms"]) == (0.3, 0.0)
    assert (row["backward_ms"], row["idle_backward_ms"]) == (0.64, 0.14)
    assert row["gaps"] == [{"at_ms": 0.3, "ms": 0.14, "phase": "backward"}]
    assert row["copies"] == [{"stream": 20, "direction": "d2h", "busy_ms": 0.3, "bytes": 4096,
                              "hidden": pytest.approx(160 / 300), "on_compute_stream": False}]
    assert row["copy_overlap"] == pytest.approx(160 / 300)


def test_multi_stage_rows_are_compared_with_the_same_schedule_without_vpipe():
    bench_module = _throughput_bench()
    names = ["GPipe (all R)", "ZBV (all D)", "ZBV + vpipe", "Interleaved 1F1B (all D)"]
    variants = [{"name": n, "schedule": "zbv" if "ZBV" in n else "gpipe", "vpipe": "vpipe" in n,
                 "micro_batch_size": 8, "micro_batches": 4} for n in names]
    case = {"model": "transformer", "stages": 2, "global_batch": 32, "budget_bytes": 5 << 20,
            "partition": [3, 3],
            "virtual_partition": [2, 1, 1, 2], "base": {"micro_batches": 4}, "variants": variants,
            "fits": {"Interleaved 1F1B + vpipe": {"fits": False}}}
    seconds = {"GPipe (all R)": 0.1, "ZBV (all D)": 0.2, "ZBV + vpipe": 0.1, "Interleaved 1F1B (all D)": 0.4}
    ranks = [{"times": {n: [[s], [s]] for n, s in seconds.items()}, "ideal_compute_s": [0.01, 0.01],
              "states": {}}
             for _ in range(2)]
    args = bench_module.parse_args(["--cores", "2"])
    result = bench_module.summarise(args, case, ranks)
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["ZBV + vpipe"]["vs_without_vpipe"]["median"] == pytest.approx(2.0)  # against ZBV (all D)
    assert rows["Interleaved 1F1B (all D)"]["vs_without_vpipe"] is None
    text = report.results_markdown({"throughput": {"cases": [result]}})
    assert (
        "budget 5.0 MiB per rank, global batch 32, partition [3, 3] ([2, 1, 1, 2] on the virtual stages)"
        in text
    )
    assert "| ZBV + vpipe | 8 x 4 | 320.0 | 2.00x (2.00-2.00) | 1.00x (1.00-1.00) | 20% |" in text
    assert "| Interleaved 1F1B + vpipe | - | does not fit |" in text


def test_each_vpipe_system_runs_right_after_the_same_schedule_without_it():
    from vpipe_lab.runtime.variants import Variant

    names = ["GPipe (all R)", "1F1B (all D)", "PipeDream (all D)", "GPipe + vpipe", "1F1B + vpipe",
             "PipeDream + vpipe", "ZBV (all D)", "ZBV + vpipe", "1F1B, no budget (all D)"]
    ordered = _throughput_bench()._pairs_adjacent([Variant(n, "1f1b", 8, 4) for n in names])
    assert [v.name for v in ordered] == ["GPipe (all R)", "GPipe + vpipe", "1F1B (all D)", "1F1B + vpipe",
                                         "PipeDream (all D)", "PipeDream + vpipe", "ZBV (all D)",
                                         "ZBV + vpipe",
                                         "1F1B, no budget (all D)"]


def _tm_rows(ratios: dict[str, float]) -> list[dict]:
    return [{"variant": v, "step_s": 0.05 * r, "ratio_vs_plain": r, "ratio_min": r, "ratio_max": r,
             "peak_vs_plain": 1.0, "policies": "SSSS" if v == "vpipe S" else "DDDD"}
            for v, r in ratios.items()]


def test_the_gpu_section_is_regenerated_from_the_suite_files_and_holds_each_number_to_its_target(tmp_path):
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    config = {"blocks": 4, "d_model": 256, "seq_len": 128, "micro_batches": 4, "micro_batch_size": 8,
              "rounds": 7}
    (gpu / "cuda_tests.json").write_text(json.dumps({"summary": "8 passed in 41.0s"}))
    (gpu / "tensor_manager.json").write_text(json.dumps({
        "config": config, "device": "cuda (NVIDIA H100 80GB HBM3)", "torch": "2.11.0+cu130",
        "rows": _tm_rows({"plain": 1.0, "vpipe D": 1.01, "vpipe S": 1.8, "save_on_cpu": 1.66, "vpipe R": 1.9,
                          "checkpoint": 1.98})}))
    (gpu / "memory_bound.json").write_text(json.dumps({
        "config": {**config, "d_model": 2048}, "memory": {"cap_bytes": 9 << 30}, "plain_largest": 4,
        "budget_bytes": 7 << 30, "micro_batches": 8, "device": "cuda (NVIDIA H100 80GB HBM3)",
                                                       "torch": "2.11.0+cu130",
        "at_twice_plain": {"vpipe": {"samples_per_s": 120.0, "policies": "DSSSSD", "escalations": 4,
                                    "budget_waits": 2.5, "budget_wait_s": 0.0123, "copy_s": 0.0841,
                                    "copy_hidden": 0.93},
                           "checkpoint": {"samples_per_s": 100.0}, "save_on_cpu": {"samples_per_s": 50.0}},
        "vpipe_over_checkpoint": 1.2, "vpipe_over_save_on_cpu": 2.4, "per_sample_limit_s": 0.0075,
        "largest": {"plain": {"largest": 4, "tried": [{"micro_batches": 4, "fits": True,
                                                       "per_sample_s": 0.0068},
                                                      {"micro_batches": 5, "fits": False}]},
                    "vpipe": {"largest": 12, "tried": [{"micro_batches": 12, "fits": True,
                                                        "per_sample_s": 0.0072}]}},
        "vpipe_largest_over_plain": 3.0}))
    compute_alloc = json.loads((gpu / "memory_bound.json").read_text())
    compute_alloc["config"]["prefetch_alloc"] = "compute"
    (gpu / "memory_bound_compute_alloc.json").write_text(json.dumps(compute_alloc))
    (gpu / "launch_bound_compute_alloc.json").write_text(json.dumps({
        "config": {**config, "rounds": 15, "prefetch_alloc": "compute"},
        "rows": _tm_rows({"plain": 1.0, "vpipe S": 1.5, "save_on_cpu": 1.66})}))
    (gpu / "host_cost.json").write_text(json.dumps({
        "config": config, "rows": [
            {"variant": "plain", "bytecodes": 42653, "vpipe_bytecodes": 0, "operations": 2616,
             "operations_beyond_plain": 0, "most_beyond_plain": []},
            {"variant": "vpipe S", "bytecodes": 615108, "vpipe_bytecodes": 565584, "operations": 3319,
             "operations_beyond_plain": 703, "most_beyond_plain": [["aten.empty_like", 312],
                                                                   ["aten.detach", 308]]}]}))
    (gpu / "timeline_2048.json").write_text(json.dumps({
        "config": {"d_model": 2048, "micro_batch_size": 8}, "micro_batches": 8, "vpipe_policies": "DSSSSS",
        "systems": {"vpipe": {"step_s": 0.5, "phase_split": "device", "idle_forward_ms": 2.0,
                              "forward_ms": 160.0,
                              "idle_backward_ms": 50.0, "backward_ms": 340.0,
                              "copies": [{"direction": "h2d", "busy_ms": 125.0, "bytes": 6 << 30,
                                          "hidden": 0.8,
                                          "on_compute_stream": False}],
                              "gaps": [{"at_ms": 244.0, "ms": 11.2, "phase": "backward"},
                                       {"at_ms": 10.0, "ms": 0.2, "phase": "forward"}]},
                    "checkpoint": {"error": "out of memory"}}}))
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# B\n<!-- results:start -->\n<!-- results:end -->\n## GPU\n<!-- gpu:start -->\nold\n"
                    "<!-- gpu:end -->\nkept\n")
    assert report.main([str(tmp_path), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "\nold\n" not in text and text.endswith("<!-- gpu:end -->\nkept\n")
    assert "Measured on cuda (NVIDIA H100 80GB HBM3) with torch 2.11.0+cu130" in text
    assert "- **`cuda` tests** (`pytest -m cuda`): 8 passed in 41.0s." in text
    assert "every layer kept: 1.01x vs <= 1.02x: met" in text
    assert "all swapped vs save_on_cpu: 1.80x vs <= 1.66x: NOT met" in text
    assert "all recomputed vs checkpoint: 1.90x vs <= 1.98x: met" in text
    # all-swapped once more with prefetched copies from the compute
    # stream's memory: its own table, that says so
    assert ("median of 15 rounds (`tensor_manager_bench.py`); vpipe's prefetched copies "
            "allocated from the compute stream's memory (`VPIPE_PREFETCH_ALLOC=compute`)") in text
    assert "all swapped vs save_on_cpu: 1.50x vs <= 1.66x: met" in text
    assert "vpipe / all-recompute: 1.20x vs >= 1.15x: met" in text
    assert "| vpipe S | 615,108 | 565,584 | 3,319 | 703 | empty_like 312, detach 308 |" in text
    # the run with prefetched copies from the compute stream's memory: a table of its own, that says so
    assert text.count("**Memory-bound**") == 2 and text.count("(`VPIPE_PREFETCH_ALLOC=compute`). At 8") == 1
    assert "vpipe's largest / plain's: 3.00x vs >= 2.00x: met" in text
    assert "| plain | 4 | 4: 6.80 ms, 5: OOM |" in text
    assert ("| vpipe | 120.0 | - | policies DSSSSD, 4 escalations; 2.5 waits for "
            "swap-outs per step, 12.3 ms; copies 84 ms/step, 93% hidden |") in text
    assert ("- vpipe: step 500 ms; idle 2.0 of 160 ms in the forward, 50.0 of 340 ms in the "
            "backward; copies h2d "
            "125 ms (6.00 GiB, 80% under kernels); longest gaps 11.2 ms at 244 ms (backward)\n"
            "- checkpoint: out of memory") in text
    assert "_Not in this run: `swap.json`, `tensor_manager_compute.json`._" in text
    # listed in their own section only
    assert "gpu_" not in report.results_markdown(report.load_results(tmp_path))
