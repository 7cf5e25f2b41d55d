"""Smoke test of the MQAR example: data, a short training run, the CLI and the plot."""

import sys

import pytest
import torch

import flexdma
from flexdma.examples import mqar


def test_make_batch_pairs_and_targets():
    cfg = mqar.MQARConfig(num_keys=16, num_values=16, num_pairs=4, num_queries=3)
    tokens, targets = mqar.make_batch(cfg, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert tokens.shape == targets.shape == (8, cfg.seq_len)
    assert (targets[:, : 2 * cfg.num_pairs] == -100).all()
    for b in range(8):
        pairs = dict(zip(tokens[b, 0:8:2].tolist(), tokens[b, 1:8:2].tolist()))
        assert len(pairs) == 4  # distinct keys
        assert all(k < 16 <= v < 32 for k, v in pairs.items())
        for q, t in zip(tokens[b, 8:].tolist(), targets[b, 8:].tolist()):
            assert pairs[q] == t


@pytest.fixture
def one_thread():
    # The tiny model runs fastest single-threaded (and is not slowed down by a busy machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_short_training_learns(one_thread):
    backend = "cpu" if "cpu" in flexdma.available_backends() else "reference"
    cfg = mqar.MQARConfig(num_keys=8, num_values=8, num_pairs=2, num_queries=2)
    res = mqar.train(steps=150, backend=backend, batch=32, cfg=cfg, progress=False, device=torch.device("cpu"))
    assert res["test_accuracy"] > 2 * res["chance"], res["test_accuracy"]
    assert res["curve"][-1][1] < res["curve"][0][1]


def test_cli_and_plot(tmp_path, capsys, one_thread):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curve.png"
    mqar.main(["--steps", "5", "--backend", "reference", "--plot", str(out)])
    assert "final test accuracy" in capsys.readouterr().out
    assert out.stat().st_size > 0


@pytest.fixture
def no_training(monkeypatch):
    def train(**kw):
        raise AssertionError("training started")

    monkeypatch.setattr(mqar, "train", train)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--batch", "0"], "argument --batch: expected a positive integer, got 0"),
        (["--threads", "0"], "argument --threads: expected a positive integer, got 0"),
        (["--steps", "-3"], "argument --steps: expected a positive integer, got -3"),
        (["--lr", "0"], "argument --lr: expected a positive number, got 0"),
        (["--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
        (["--epochs", "3"], "unrecognized arguments: --epochs 3"),
    ],
    ids=["steps 0", "batch 0", "threads 0", "steps -3", "lr 0", "backend tpu", "unknown flag"],
)
def test_cli_rejects_bad_arguments(argv, message, capsys, no_training):
    with pytest.raises(SystemExit) as e:
        mqar.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_help_shows_defaults(capsys, no_training):
    with pytest.raises(SystemExit) as e:
        mqar.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 1500)", "(default: auto)", "(default: 64)", "(default: 18)", "(default: 1)"):
        assert default in out


def test_cli_plot_needs_matplotlib_before_training(monkeypatch, capsys, no_training, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as e:
        mqar.main(["--steps", "5", "--plot", str(tmp_path / "curve.png")])
    assert e.value.code == 2
    assert "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err
