"""Smoke test of the MQAR example: data, a short training run, the CLI and the plot."""
import pytest
import torch

import flexdma
from flexdma.examples import mqar


def test_make_batch_pairs_and_targets():
    cfg = mqar.MQARConfig(num_keys=16, num_values=16, num_pairs=4, num_queries=3)
    tokens, targets = mqar.make_batch(cfg, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert tokens.shape == targets.shape == (8, cfg.seq_len)
    assert (targets[:, :2 * cfg.num_pairs] == -100).all()
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
