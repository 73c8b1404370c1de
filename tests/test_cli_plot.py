"""``--plot`` (batchfit.cli.render_budget.budget_figure / plot_budget): every pass's limit, no colour twice, one write."""

from __future__ import annotations

import pytest

from batchfit.budget import TokenBudget
from batchfit.budget.probe import Probe
from batchfit.cli.render_budget import budget_figure, plot_budget

pytest.importorskip("matplotlib")

GiB = 2**30


def _budget(role: str, limit: int, lengths: tuple[int, ...]) -> TokenBudget:
    trials = tuple(Probe(b, s, b * s * 1024, fits=b < 4, exceeded=b == 4) for s in lengths for b in (1, 2, 3, 4))
    return TokenBudget(
        tokens=3 * lengths[-1], max_seq_len=lengths[0], cost="padded", points=(), memory_model=None,
        probes=len(trials), limit_bytes=limit, usable_bytes=limit, safety_margin=0.85, backend="estimate",
        role=role, trials=trials,
    )  # fmt: skip


def _passes() -> dict[str, TokenBudget]:
    # the update pass's limit is below the forward pass's (resident state): 12 series of probes in all
    lengths = (4096, 2048, 1024, 512, 256, 128)
    return {"policy": _budget("policy", 40 * GiB, lengths), "policy_forward": _budget("policy_forward", 60 * GiB, lengths)}


def test_every_pass_s_limit_is_drawn_in_its_colour_and_no_series_shares_a_colour():
    import matplotlib.pyplot as plt

    fig = budget_figure(_passes())
    try:
        ax = fig.axes[0]
        series = [line for line in ax.get_lines() if line.get_label().startswith(("policy:", "policy_forward:"))]
        assert len(series) == 12
        colours = [tuple(line.get_color()) for line in series]
        assert len(set(colours)) == 12  # the default cycle has 10: main reused two
        limits = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if "limit" in line.get_label()}
        assert limits == {"policy limit 40.00 GiB": 40.0, "policy_forward limit 60.00 GiB": 60.0}
    finally:
        plt.close(fig)


def test_one_shared_limit_is_one_line_and_the_file_is_written_once(tmp_path, monkeypatch):
    import matplotlib.figure

    passes = _passes()
    passes["policy_forward"] = _budget("policy_forward", 40 * GiB, (4096, 2048))
    writes = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: writes.append(a) or real(self, *a, **k))
    plot_budget(passes, str(tmp_path / "budget.png"))
    assert len(writes) == 1 and (tmp_path / "budget.png").stat().st_size > 1000
    fig = budget_figure(passes)
    limits = [line.get_label() for line in fig.axes[0].get_lines() if "limit" in line.get_label()]
    assert limits == ["limit 40.00 GiB"]
