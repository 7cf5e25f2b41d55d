"""CPU smoke test of the benchmark suite's plumbing: configurations, derived figures, JSON naming,
markdown, report regeneration from a small fake result file, and the equivalence subcommand."""

import json
import math
import os
import sys

import pytest
import torch

# The suite lives beside the package, not in it: make the repository root importable however pytest is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import cli, configs, inputs, report  # noqa: E402


def test_configs_cover_the_issue_sweeps():
    fwd = configs.training_cases(("fwd",))
    assert {c.Q for c in fwd} == set(2**i for i in range(8, 16))
    assert all(c.Q == c.K and c.W == 1024 for c in fwd)
    assert {(c.D, c.bias) for c in fwd} == {(64, "per-row"), (64, "per-key"), (128, "per-row"), (128, "per-key")}
    win = configs.window_cases(("fwd", "bwd"))
    assert {c.W for c in win} == set(2**i for i in range(5, 16)) and {c.K for c in win} == {32768}
    dec = configs.decode_cases()
    assert {c.K for c in dec} == set(2**i for i in range(8, 20)) and {c.Q for c in dec} == {1}
    assert {c.bias_shape[2] for c in dec} == {1}
    assert configs.Case("train", 8, 8, 4, 64, "per-key").bias_shape == (1, 1, 1, 8)
    assert configs.Case("train", 8, 8, 4, 64, "per-row").bias_shape == (1, 1, 8, 8)
    quick = configs.training_cases(("fwd",), quick=True, ds=[64], biases=["per-key"])
    assert {(c.D, c.bias) for c in quick} == {(64, "per-key")} and max(c.Q for c in quick) <= 16384


def test_parse_list_and_limits():
    assert configs.parse_list("64, 128", configs.HEAD_DIMS, int) == [64, 128]
    assert configs.parse_list(None, configs.HEAD_DIMS) is None
    with pytest.raises(ValueError, match="subset"):
        configs.parse_list("96", configs.HEAD_DIMS, int)
    assert configs.parse_list("256,192", configs.ANY_HEAD_DIMS, int) == [256, 192]  # what --d accepts
    with pytest.raises(ValueError):
        configs.parse_list("per-col", configs.BIAS_KINDS)
    big = configs.Case("train", 32768, 32768, 1024, 128, "per-row", ("bwd",))
    small = configs.Case("train", 4096, 4096, 1024, 128, "per-row", ("bwd",))
    assert configs.limit_reason("sdpa", "bwd", big) and configs.limit_reason("sdpa", "bwd", small) is None
    assert configs.limit_reason("sdpa", "fwd", big) is None


def test_inputs_mask_is_top_w_of_visible_and_counts():
    case = configs.Case("train", 40, 40, 8, 64, "per-key")
    inp = inputs.make_inputs(case, "cpu", seed=3)
    assert inp.mask.shape == (1, 1, 40, 40) and inp.mask.dtype == torch.bool
    rows = inp.mask[0, 0].sum(-1)
    # bottom-right causal with Q == K: row i sees i+1 keys, keeps min(W, i+1)
    assert rows.tolist() == [min(8, i + 1) for i in range(40)]
    assert not torch.triu(inp.mask[0, 0], diagonal=1).any()
    # per-key bias: a kept key beats every visible, dropped key of its row
    i = 30
    vis = inp.bias[0, 0, 0, : i + 1].float()
    kept = inp.mask[0, 0, i, : i + 1]
    assert vis[kept].min() >= vis[~kept].max()
    assert inp.pairs == int(inp.mask.sum())
    assert inputs.flops(case, 100, "bwd") == 2.5 * inputs.flops(case, 100, "fwd") == 2.5 * 4 * 64 * 100 * 2
    f, b = inputs.bytes_moved(case, "fwd"), inputs.bytes_moved(case, "bwd")
    assert f == 2 * (40 * 2 * 64 * 2) + 2 * (40 * 64 * 2) + 40 * 40 + 40 * 2 and b > f


def test_gpu_short_and_result_path(tmp_path):
    assert cli.gpu_short("NVIDIA H100 80GB HBM3") == "h100"
    assert cli.gpu_short("NVIDIA H200") == "h200"
    assert cli.gpu_short("cpu (x86_64)") == "cpu"
    assert cli.gpu_short("") == "device"
    env = {"gpu_short": "h100", "date": "2026-11-22T10:00:00Z", "commit": "abc1234"}
    assert os.path.basename(cli.result_path(str(tmp_path), env, "forward")) == "h100_20261122_abc1234_forward.json"


def test_commit_label_must_name_a_file(tmp_path, capsys):
    # The label is part of the result file's name: a character outside [0-9A-Za-z._-] is refused
    # before anything runs, and a git revision with -dirty is taken.
    for bad in ("abc1234+wip", "a/b", "a b", ""):
        with pytest.raises(SystemExit):
            cli.main(["report", "--commit", bad, "--results", str(tmp_path), "--md", str(tmp_path / "r.md")])
        assert "--commit" in capsys.readouterr().err
    assert cli._parse(["perkey", "--commit", "abc1234-dirty"]).commit == "abc1234-dirty"


def test_recorded_argv_hides_directories():
    assert cli.public_argv(["forward", "--out", "/x/y", "--quick", "--md=/a/b.md"]) == [
        "forward",
        "--out",
        "DIR",
        "--quick",
        "--md=DIR",
    ]


def _fake_doc(sub="forward"):
    rows = []
    for K, auto_ms in ((1024, 0.05), (4096, 0.2)):
        case = configs.Case("train", K, K, 1024, 128, "per-row", ("fwd",))
        row = dict(
            case.as_dict(),
            dir="fwd",
            pairs=K * 100,
            density=0.1,
            flops=inputs.flops(case, K * 100, "fwd"),
            bytes=inputs.bytes_moved(case, "fwd"),
            results={
                "flexdma-auto": {"status": "ok", "ms": auto_ms, "peak_mib": 10.0, "extra_mib": 1.0},
                "sdpa": {"status": "ok", "ms": 2 * auto_ms, "peak_mib": 20.0, "extra_mib": 5.0},
                "flexattn": {"status": "oom", "reason": "CUDA out of memory"},
                "dense": {"status": "skipped", "reason": "skipped: test"},
            },
        )
        cli._derive(row, case)
        rows.append(row)
    return dict(
        schema=report.SCHEMA,
        subcommand=sub,
        gpu="NVIDIA H100 80GB HBM3",
        gpu_short="h100",
        torch="2.11.0",
        cuda="13.0",
        triton="3.6.0",
        commit="abc1234",
        dirty=False,
        date="2026-11-22T10:00:00Z",
        timing=dict(warmup_ms=25, rep_ms=100, stat="median", tool="do_bench"),
        peer_notes={"flash_dmattn": "not importable"},
        rows=rows,
        not_run=[],
    )


def test_derived_figures():
    row = _fake_doc()["rows"][0]
    auto = row["results"]["flexdma-auto"]
    assert auto["tflops"] == pytest.approx(row["flops"] / (0.05e-3) / 1e12)
    assert auto["gbps"] == pytest.approx(row["bytes"] / (0.05e-3) / 1e9)
    assert row["speedup"]["flexdma-auto"] == {"sdpa": pytest.approx(2.0)}
    assert "tflops" not in row["results"]["flexattn"]


def test_markdown_tables():
    doc = _fake_doc()
    md = report.markdown(doc, detail=True)
    summary = md.strip().splitlines()
    # the summary table comes last; its header names every peer and the speedup columns
    assert "flexdma-auto ms" in md and "flexdma-auto vs sdpa" in md and "2.00x" in summary[-1]
    assert "OOM" in summary[-1] and "skip" in summary[-1]
    assert "commit abc1234" in md and "flash_dmattn` not run" in md
    n_cols = summary[-1].count("|")
    assert all(line.count("|") == n_cols for line in summary[-4:])


def test_report_regenerates_results_md(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    old = _fake_doc()
    old["date"], old["commit"] = "2026-11-01T00:00:00Z", "old0000"
    (res / "h100_20261101_old0000_forward.json").write_text(json.dumps(old))
    (res / "h100_20261122_abc1234_forward.json").write_text(json.dumps(_fake_doc()))
    (res / "h100_cuda_dev_run1.json").write_text(json.dumps({"device": "other tool's file"}))
    md = tmp_path / "RESULTS.md"
    assert cli.main(["report", "--results", str(res), "--md", str(md)]) == 0
    text = md.read_text()
    assert "abc1234" in text and "old0000" not in text  # newest per (GPU, subcommand)
    assert "## forward (h100)" in text and "| train | fwd | per-row | 128 | 4096 |" in text
    pytest.importorskip("matplotlib")
    assert (res / "h100_20261122_abc1234_forward.png").stat().st_size > 1000
    assert "h100_20261122_abc1234_forward.png" in text


def test_report_merges_runs_of_one_commit(tmp_path):
    # A sweep split over calls: the second run measures what the first left out (not_run), and
    # also re-measures one of its cases; an older commit's file is not mixed in.
    first, second, old = _fake_doc(), _fake_doc(), _fake_doc()
    keep, redo = first["rows"]
    first["rows"], first["not_run"] = [keep, redo], ["train-per-key-D64-Q8192-K8192-W1024"]
    extra = json.loads(json.dumps(redo))
    extra.update(bias="per-key", D=64, Q=8192, K=8192)
    again = json.loads(json.dumps(redo))
    again["results"]["flexdma-auto"]["ms"] = 123.0
    second["rows"], second["date"] = [extra, again], "2026-11-22T11:00:00Z"
    old["commit"], old["date"] = "old0000", "2026-11-21T00:00:00Z"
    old["rows"] = old["rows"][:1]
    paths = [tmp_path / n for n in ("h100_a_forward.json", "h100_b_forward_part4.json")]
    for p, d in zip(paths, (first, second)):
        p.write_text(json.dumps(d))
    (tmp_path / "h100_old_forward.json").write_text(json.dumps(old))
    [doc] = report.load_results(str(tmp_path))
    assert doc["commit"] == "abc1234" and doc["not_run"] == [] and len(doc["rows"]) == 3
    assert [
        r["results"]["flexdma-auto"]["ms"]
        for r in doc["rows"]
        if r["Q"] == redo["Q"] and r["D"] == redo["D"] and r["bias"] == redo["bias"]
    ] == [123.0]  # the later run's figure
    assert doc["_paths"] == [str(p) for p in paths]
    assert "the 2 invocations merged here" in report.header(doc)
    # the window sweep has a forward and a backward row per case: both survive a merge
    bwd = json.loads(json.dumps(keep))
    bwd["dir"] = "bwd"
    assert len(report._merge([dict(first, rows=[keep], _path="a"), dict(second, rows=[bwd], _path="b")])["rows"]) == 2


def test_progress_falls_back_to_prints(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    p = cli.Progress(2, "x")
    p.step("first")
    p.close()
    assert "[x 1/2] first" in capsys.readouterr().err


def test_timing_subcommands_need_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("only meaningful without a GPU")
    with pytest.raises(SystemExit, match="CUDA"):
        cli.main(["forward", "--quick", "--out", str(tmp_path), "--commit", "test000"])


def test_equivalence_subcommand_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the GPU run covers it")
    assert (
        cli.main(
            [
                "equivalence",
                "--quick",
                "--d",
                "64",
                "--bias",
                "per-key",
                "--peers",
                "flexdma-auto,sdpa",
                "--out",
                str(tmp_path),
                "--commit",
                "test000",
            ]
        )
        == 0
    )
    files = list(tmp_path.glob("*_test000_equivalence.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["schema"] == report.SCHEMA and len(doc["rows"]) == 2
    for row in doc["rows"]:
        for peer in ("flexdma-auto", "sdpa"):
            r = row["results"][peer]
            assert r["status"] == "ok" and r["within_tol"], (peer, r)
            assert set(r) >= {"out", "dq", "dk", "dv", "dbias"} and r["out"]["rel"] < 0.02
    assert "bf16 eager reference" in capsys.readouterr().out


def test_perkey_benchmark_table_and_report_section(tmp_path):
    from benchmarks import perkey

    doc = dict(
        schema=perkey.SCHEMA,
        date="2026-11-23T00:00:00Z",
        gpu_short="h100",
        commit="abc1234",
        rows=[
            dict(
                case=perkey.cases(quick=True)[0],
                peers={
                    "flexdma": dict(fwd_ms=0.5, bwd_ms=1.0, fwd_bwd_ms=1.5, fwd_peak_mib=10.0, fwd_bwd_peak_mib=20.0),
                    "sdpa": dict(fwd_ms=1.0, bwd_ms=2.5, fwd_bwd_ms=3.5),
                    "flex": dict(error="RuntimeError: boom"),
                    "dense-mask": dict(skipped="the dense mask is 131072 x 131072 bools"),
                },
            ),
            dict(case=perkey.cases(quick=True)[-1], not_run="time budget"),
        ],
    )
    (tmp_path / "x.json").write_text(__import__("json").dumps(doc))
    doc["rows"][0]["listed_flops"], doc["rows"][0]["dense_flops"] = perkey.flops(perkey.cases(quick=True)[0])
    doc["rows"][0]["peers"]["flexdma"].update(fwd_launches=7, fwd_bwd_launches=15)
    (tmp_path / "x.json").write_text(__import__("json").dumps(doc))
    md = "\n".join(perkey.section(str(tmp_path)))
    assert "0.500 / 1.500" in md and "2.00x / 2.33x" in md and "error: RuntimeError" in md
    assert "not run: time budget" in md and "commit abc1234" in md and "| 7 / 15 |" in md
    # 32K rows keep W = 2048 keys of up to 32K: the ideal is SDPA's time x listed / dense pairs.
    listed, dense = doc["rows"][0]["listed_flops"], doc["rows"][0]["dense_flops"]
    assert f"{1.0 * listed / dense:.3f} / {3.5 * listed / dense:.3f}" in md


def test_perkey_report_keeps_the_run_with_every_peer(tmp_path):
    # A newer run of flexdma and SDPA alone (a before / after comparison) does not replace the
    # table of the newest run that measured FlexAttention too; it follows as a section of its own.
    from benchmarks import perkey

    case = perkey.cases(quick=True)[0]
    timed = dict(fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0)
    full = {p: dict(timed) for p in ("sdpa", "flexdma", "flex", "flex-window")}
    for name, date, commit, peers in (
        ("full.json", "2026-11-23T00:00:00Z", "aaa1111", full),
        ("partial.json", "2026-11-24T00:00:00Z", "bbb2222", {p: full[p] for p in ("sdpa", "flexdma")}),
    ):
        doc = dict(
            schema=perkey.SCHEMA, date=date, gpu_short="h100", commit=commit, rows=[dict(case=case, peers=peers)]
        )
        (tmp_path / name).write_text(__import__("json").dumps(doc))
    md = "\n".join(perkey.section(str(tmp_path)))
    assert md.index("## per-key top-W (h100, commit aaa1111)") < md.index(
        "## per-key top-W, the newest run (h100, commit bbb2222)"
    )
    (tmp_path / "full.json").unlink()
    md = "\n".join(perkey.section(str(tmp_path)))
    assert "## per-key top-W (h100, commit bbb2222)" in md and "the newest run" not in md


def test_perkey_report_fills_a_cut_run_from_the_newest_finished_one(tmp_path):
    # The newest run with every peer was cut by its time budget (rows not run, Doge rows short):
    # its table still leads, the newest run that finished follows, and the Doge rows are that run's.
    import json

    from benchmarks import perkey

    case = perkey.cases(quick=True)[0]
    timed = dict(fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0)
    full = {p: dict(timed) for p in ("sdpa", "flexdma", "flex", "flex-window")}
    doge = lambda L: dict(case=dict(name=f"Doge train step L={L}K", L=L), peers={"flexdma": dict(ms=1.0, peak_mib=2.0)})  # noqa: E731
    runs = (
        ("old.json", "2026-11-22T00:00:00Z", "aaa1111", full, [doge(16), doge(64)], False),
        ("done.json", "2026-11-23T00:00:00Z", "bbb2222", {"sdpa": full["sdpa"], "flexdma": full["flexdma"]}, [], False),
        ("cut.json", "2026-11-24T00:00:00Z", "ccc3333", full, [doge(16)], True),
    )
    for name, date, commit, peers, doge_rows, cut in runs:
        doc = dict(schema=perkey.SCHEMA, date=date, gpu_short="h200", commit=commit, doge=doge_rows)
        doc["rows"] = [dict(case=case, peers=peers)]
        if cut:
            doc["rows"].append(dict(case=perkey.cases(quick=True)[1], not_run="time budget"))
            doc["unfinished"] = True
        (tmp_path / name).write_text(json.dumps(doc))
    md = "\n".join(perkey.section(str(tmp_path)))
    assert md.index("## per-key top-W (h200, commit ccc3333)") < md.index(
        "## per-key top-W, the newest run that finished (h200, commit bbb2222)"
    )
    assert "Doge train step L=64K" in md and "The Doge rows are commit aaa1111's run" in md
    # A run that ended by itself but left rows out for its time budget is cut too.
    doc = json.loads((tmp_path / "cut.json").read_text())
    del doc["unfinished"]
    (tmp_path / "cut.json").write_text(json.dumps(doc))
    md = "\n".join(perkey.section(str(tmp_path)))
    assert "## per-key top-W, the newest run that finished (h200, commit bbb2222)" in md
    assert "The Doge rows are commit" not in md.split("## per-key top-W, the newest run that finished")[0]
    (tmp_path / "cut.json").unlink()
    md = "\n".join(perkey.section(str(tmp_path)))
    assert "the newest run that finished" not in md and "Doge rows are commit" not in md


def test_perkey_report_merges_a_run_split_by_head_dim(tmp_path):
    # One commit's per-key run in two calls (--d 128 with the Doge rows, then --d 64) reads as one
    # table; with the D = 64 half missing the table says so and the newest finished run follows.
    import json

    from benchmarks import perkey

    timed = dict(fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0)
    full = {p: dict(timed) for p in ("sdpa", "flexdma", "flex", "flex-window")}
    doge = [dict(case=dict(name="Doge train step L=16K", L=16384), peers={"flexdma": dict(ms=1.0, peak_mib=2.0)})]
    old = dict(schema=perkey.SCHEMA, date="2026-11-22T00:00:00Z", gpu_short="h200", commit="aaa1111", doge=[])
    old["rows"] = [dict(case=c, peers={"flexdma": dict(timed)}) for c in perkey.cases()]
    (tmp_path / "old.json").write_text(json.dumps(old))
    for d, date in ((128, "2026-11-23T00:00:00Z"), (64, "2026-11-23T01:00:00Z")):
        doc = dict(schema=perkey.SCHEMA, date=date, gpu_short="h200", commit="bbb2222", dims=[d])
        doc["rows"] = [dict(case=c, peers=full) for c in perkey.cases() if c["D"] == d]
        doc["doge"] = doge if d == 128 else []
        (tmp_path / f"d{d}.json").write_text(json.dumps(doc))
    md = "\n".join(perkey.section(str(tmp_path)))
    assert "## per-key top-W (h200, commit bbb2222)" in md and "aaa1111" not in md
    assert "| L=32K D=64 | 1.000 / 3.000" in md and "| L=32K D=128 | 1.000 / 3.000" in md
    assert "Doge train step L=16K" in md and "not run" not in md
    (tmp_path / "d64.json").unlink()
    md = "\n".join(perkey.section(str(tmp_path)))
    assert "| L=32K D=64 |" not in md.split("aaa1111")[0]  # the D = 128 half alone: its rows only
    assert "## per-key top-W, the newest run that finished (h200, commit aaa1111)" in md


def test_perkey_subcommand_takes_head_dims(tmp_path):
    from benchmarks import cli, perkey

    args = cli._parse(["perkey", "--d", "96", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--d"):
        perkey.main(args, dict(gpu_short="h200", date="2026-11-29T00:00:00Z", commit="x"))


def test_dense_model_section_says_when_flexattention_lacked_its_d64_tile(tmp_path):
    # A cuda_dev run whose FlexAttention option sets lacked the 64-key forward tile did not time
    # FlexAttention's best D = 64 forward on sm_90: the section says so; a run with it does not.
    import json

    doc = {
        f"model_8192_d{d}_{p}_{x}_ms": 1.0
        for d in (64, 128)
        for p in ("flexdma", "flexattn", "sdpa")
        for x in ("fwd", "bwd")
    }
    doc.update(model_flex_bias_grad=True, run_at="2026-11-25T00:00:00Z")
    for sets, says in ((["defaults", "small", "one_stage"], True), (["defaults", "key_tile_64"], False)):
        (tmp_path / "h100_x_cuda_dev.json").write_text(json.dumps(dict(doc, model_flex_option_sets=sets)))
        text = "\n".join(report.cuda_dev_section(str(tmp_path)))
        assert "| B=2 L=8192 D=64 | 1.000 / 1.000 |" in text
        assert ("without the 64-key forward tile" in text) == says
    # The heading names the GPU the run recorded, not a fixed one.
    (tmp_path / "h100_x_cuda_dev.json").write_text(json.dumps(dict(doc, device="NVIDIA H200")))
    assert "## dense-mask kernels at model shapes (h200, `h100_x_cuda_dev.json`)" in report.cuda_dev_section(
        str(tmp_path)
    )


def test_decode_benchmark_table_and_report_section(tmp_path):
    from benchmarks import decode

    c = decode.cases(quick=True)[0]
    doc = dict(
        schema=decode.SCHEMA,
        date="2026-11-25T00:00:00Z",
        gpu_short="h100",
        commit="abc1234",
        rows=[
            dict(case=c, peers={"api": dict(ms=1.04), "layer-step": dict(ms=0.0213), "sdpa": dict(error="OOM")}),
            dict(case=c, not_run="time budget"),
        ],
        generate=[
            dict(
                case=dict(name="Doge generate B=1 prompt=8K"),
                peers={
                    "flexdma": dict(prefill_s=0.5, decode_tokens_per_s=120.0, peak_mib=900.0),
                    "eager": dict(skipped="its prefill builds masks"),
                },
            )
        ],
    )
    (tmp_path / "d.json").write_text(__import__("json").dumps(doc))
    md = "\n".join(decode.section(str(tmp_path)))
    # PEERS' order: api, layer-step, kernel, sdpa, layer-sdpa
    assert "| 1.0400 | 0.0213 | – | error: OOM | – |" in md and "not run: time budget" in md
    assert "0.50 / 120 / 900" in md and "– (its prefill builds masks)" in md and "commit abc1234" in md
    assert [r["K"] for r in decode.cases()] == [8192, 32768, 131072, 524288, 131072]
    # A later run of the generate rows alone (--peers generate: its layer rows unmeasured): the
    # layer steps stay those of the run that measured them, the generate table is the newer one's.
    later = dict(doc, date="2026-11-26T00:00:00Z", commit="def5678", rows=[dict(case=c, peers={})])
    later["generate"] = [dict(case=dict(name="Doge generate B=1 prompt=8K"), peers={"flexdma": dict(
        prefill_s=0.25, decode_tokens_per_s=800.0, peak_mib=700.0)})]  # fmt: skip
    (tmp_path / "e.json").write_text(__import__("json").dumps(later))
    md = "\n".join(decode.section(str(tmp_path)))
    steps, gen = md.split("## per-key decoding: Doge generate")
    assert "commit abc1234" in steps and "| 1.0400 | 0.0213 |" in steps and "120" not in steps
    assert "commit def5678" in gen and "0.25 / 800 / 700" in gen


def test_perkey_flop_count():
    from benchmarks import perkey

    # Q = K = 4, W = 2: rows keep 1, 2, 2, 2 keys and see 1, 2, 3, 4.
    assert perkey.kept_per_row(4, 4, 2) == (7, 10)
    # Bottom-right causal with Q < K: the rows see K - Q + 1 .. K keys.
    assert perkey.kept_per_row(2, 5, 10) == (9, 9)
    c = dict(B=2, Q=4, L=4, H=3, D=8, W=2)
    assert perkey.flops(c) == (4 * 8 * 3 * 2 * 7, 4 * 8 * 3 * 2 * 10)


def test_cpu_subcommand_and_its_report_section(tmp_path, capsys):
    assert cli.main(["cpu", "--lengths", "128", "--reps", "2", "--out", str(tmp_path), "--commit", "test000"]) == 0
    [path] = list(tmp_path.glob("*_test000_cpu.json"))
    doc = json.loads(path.read_text())
    assert doc["schema"] == report.CPU_SCHEMA and doc["subcommand"] == "cpu"
    assert [(r["kind"], r["dir"]) for r in doc["rows"]] == [
        (k, d) for k in ("dense", "top25", "top25-blocks") for d in ("fwd", "fwd+bwd")
    ]
    for r in doc["rows"]:
        assert {"flexdma-cpu", "sdpa"} <= set(r["results"]) and all(x["status"] == "ok" for x in r["results"].values())
        assert r["speedup"]["sdpa"] == r["results"]["sdpa"]["min_ms"] / r["results"]["flexdma-cpu"]["min_ms"]
        # causal: about half the pairs; top-L/4 of the visible keys: at most a quarter (whole
        # 64-key blocks round up at this length)
        assert r["density"] <= {"dense": 0.51, "top25": 0.25, "top25-blocks": 0.5}[r["kind"]]
    md = tmp_path / "RESULTS.md"
    assert cli.main(["report", "--results", str(tmp_path), "--md", str(md)]) == 0
    text = md.read_text()
    assert "## cpu (cpu)" in text and "| top25-blocks | 128 | fwd+bwd |" in text


def test_varlen_benchmark_table_and_report_section(tmp_path):
    from benchmarks import varlen

    for c in varlen.cases():
        assert sum(c["lengths"]) == c["total"] == 65536
        assert all(512 <= n <= 16384 for n in c["lengths"]) and len(c["lengths"]) > 1
    assert [c["D"] for c in varlen.cases()] == [128, 64] and varlen.cases() == varlen.cases()  # a fixed seed
    [q] = varlen.cases(quick=True)
    assert sum(q["lengths"]) == 16384 and all(512 <= n <= 4096 for n in q["lengths"])
    for seed in range(50):  # a rest shorter than the lower bound never becomes a document
        lengths = varlen.doc_lengths(4096, 512, 1024, seed)
        assert sum(lengths) == 4096 and all(512 <= n <= 1024 for n in lengths)
    c = varlen.cases()[0]
    doc = dict(
        schema=varlen.SCHEMA,
        date="2026-11-26T00:00:00Z",
        gpu_short="h100",
        commit="abc1234",
        rows=[
            dict(
                case=c,
                peers={
                    "flexdma-packed": dict(
                        fwd_ms=1.1,
                        fwd_bwd_ms=3.3,
                        fwd_launches=40,
                        fwd_bwd_launches=90,
                        fwd_peak_mib=300.0,
                        fwd_bwd_peak_mib=900.0,
                    ),
                    "flexdma-per-doc": dict(
                        fwd_ms=1.0, fwd_bwd_ms=3.0, back_to_back_fwd_ms=1.05, back_to_back_fwd_bwd_ms=3.1
                    ),
                    "flexdma-padded": dict(fwd_ms=2.2, fwd_bwd_ms=8.25, fwd_peak_mib=700.0, fwd_bwd_peak_mib=2100.0),
                    "flex-docmask": dict(error="RuntimeError: boom"),
                    "sdpa-jagged": dict(
                        fwd_ms=0.8,
                        fwd_bwd_ms=2.4,
                        fwd_backend="FLASH_ATTENTION",
                        fwd_kv_expanded="enable_gqa: RuntimeError",
                    ),
                },
            ),
            dict(case=varlen.cases()[1], not_run="time budget"),
        ],
    )
    listed, dense = varlen.flops(c)
    assert 0 < listed < dense
    (tmp_path / "v.json").write_text(json.dumps(doc))
    md = "\n".join(varlen.section(str(tmp_path)))
    assert "| 1.100 / 3.300 | 1.000 / 3.000 | 1.10x / 1.10x | 1.050 / 3.100 | 2.200 / 8.250 | 2.00x / 2.50x |" in md
    assert "error: RuntimeError: boom" in md and "FLASH_ATTENTION, KV heads expanded" in md
    assert "| 40 / 90 | 300 / 900 | 700 / 2100 |" in md and "not run: time budget" in md and "commit abc1234" in md
    assert f"{0.8 * listed / dense:.3f} / {2.4 * listed / dense:.3f} (at SDPA jagged's rate)" in md
    assert ", ".join(str(n) for n in c["lengths"]) in md
    with pytest.raises(SystemExit, match="--peers"):
        cli.main(["varlen", "--peers", "flexdma-packed,nope", "--out", str(tmp_path), "--commit", "test000"])


def test_varlen_report_keeps_the_newest_run_with_every_peer(tmp_path):
    # RESULTS.md's varlen section: the newest run that has every peer; a newer run of some peers
    # only (flexdma's rows, a quick check) is named beneath it, not in its place.
    import json

    from benchmarks import varlen

    case = varlen.cases()[0]

    def run(commit, date, peers):
        rows = [dict(case=case, peers={p: dict(fwd_ms=1.0, fwd_bwd_ms=2.0) for p in peers})]
        doc = dict(schema=varlen.SCHEMA, rows=rows, gpu_short="h200", commit=commit, date=date)
        (tmp_path / f"h200_{commit}_varlen.json").write_text(json.dumps(doc))

    run("aaa", "2026-11-26T01:00:00", varlen.PEERS)
    run("bbb", "2026-11-26T02:00:00", varlen.PEERS[:2])
    text = "\n".join(varlen.section(str(tmp_path)))
    full = text.index("commit aaa")
    assert "flexdma's rows only (h200, commit bbb)" in text and text.index("commit bbb") > full
    run("ccc", "2026-11-26T03:00:00", varlen.PEERS)
    text = "\n".join(varlen.section(str(tmp_path)))
    assert "commit ccc" in text and "commit aaa" not in text and "commit bbb" not in text


def test_cp_subcommand_on_two_gloo_ranks(tmp_path):
    # The context-parallel benchmark as torchrun starts it, on two CPU processes (gloo) at its toy
    # size: every part runs and lands in the JSON and its RESULTS.md section.
    import socket
    import subprocess

    from benchmarks import cp

    pytest.importorskip("transformers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    cmd += [f"--master-port={port}", "-m", "benchmarks", "cp", "--lengths", "512", "--out", str(tmp_path)]
    proc = subprocess.run(cmd + ["--commit", "test000"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [path] = list(tmp_path.glob("*_test000_cp_p2.json"))
    doc = json.loads(path.read_text())
    assert doc["schema"] == cp.SCHEMA and doc["world_size"] == 2 and doc["backend"] == "gloo"
    assert "unfinished" not in doc and doc["shape"] == cp.CPU["shape"]
    [row] = doc["rows"]
    assert row["case"]["L"] == 512 and row["case"]["L_local"] == 256 and "error" not in row
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["fwd_reps"] >= cp.MIN_REPS
    assert row["distinct_scores"] == 2 * 512  # float32 scores of both KV heads: no ties at this size
    assert row["bound"] == cp.exchange_bound(cp.CPU["shape"], 2, 4)
    for part in ("fwd", "train"):
        stats = row["bytes"][part]
        assert len(stats) == 2 and all(s["calls"] == 1 and s["forward_received_bytes"] > 0 for s in stats)
        for d in ("forward", "backward"):  # what one rank sends, the other receives
            assert sum(s[f"{d}_sent_bytes"] for s in stats) == sum(s[f"{d}_received_bytes"] for s in stats)
    assert all(s["backward_sent_bytes"] == 0 for s in row["bytes"]["fwd"])
    assert all(s["backward_sent_bytes"] > 0 for s in row["bytes"]["train"])
    assert row["peak"] == {"fwd": [None, None], "train": [None, None]}  # no CUDA allocator to read
    assert [r["case"]["L"] for r in doc["single"]] == [256, 512]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in doc["single"])
    [dense] = doc["dense"]
    assert "needs CUDA" in dense["skipped"]
    doge = {(r["case"]["P"], r["case"]["L"]): r for r in doc["doge"]}
    assert set(doge) == {(2, 512), (1, 128), (1, 256)}
    for r in doge.values():
        assert "error" not in r and r["ms"] > 0 and math.isfinite(r["loss"]), r
    assert all(s["calls"] == cp.TOY_DOGE["num_hidden_layers"] for s in doge[(2, 512)]["bytes"])
    md = "\n".join(cp.section(str(tmp_path)))
    assert "## context parallel, 2 ranks (cpu, commit test000)" in md
    assert f"| 512 | {row['fwd_ms']:.1f} / {row['fwd_bwd_ms']:.1f} |" in md
    assert "| Doge CP L=512 P=2 |" in md and "| Doge one GPU L=256 |" in md
    out = tmp_path / "RESULTS.md"
    assert cli.main(["report", "--results", str(tmp_path), "--md", str(out)]) == 0
    assert "## context parallel, 2 ranks" in out.read_text()


def _pid(_):
    return os.getpid()


def _die(_):
    os._exit(3)


def test_in_fresh_process_runs_apart_and_reports_a_death():
    from benchmarks.common import in_fresh_process

    assert in_fresh_process(_pid, None) != os.getpid()
    assert "died" in in_fresh_process(_die, None)["error"]


def test_perkey_times_flexattention_peers_in_fresh_processes(monkeypatch):
    # Each FlexAttention row compiles in a process of its own; the other peers run in the bench's.
    from benchmarks import perkey

    fresh, here = [], []
    monkeypatch.setattr(perkey, "in_fresh_process", lambda fn, peer, c: fresh.append(peer) or fn(peer, c))
    monkeypatch.setattr(perkey, "measure", lambda peer, c: here.append(peer) or {"fwd_ms": 1.0})
    monkeypatch.setattr(perkey, "_applies", lambda peer, c: None)
    monkeypatch.setattr(perkey, "record", lambda row, peer, rec: row["peers"].__setitem__(peer, rec))
    doc = perkey.run(quick=True, peers=("sdpa", "flex", "flex-window"), budget=0, dims=[128])
    rows = doc["rows"]
    assert rows and fresh == ["flex", "flex-window"] * len(rows)
    assert here == ["sdpa", "flex", "flex-window"] * len(rows)
    assert all(r["peers"]["flex"] == {"fwd_ms": 1.0} for r in rows)
