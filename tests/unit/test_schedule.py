import math

import pytest

from paratron.optim.schedule import LRScheduler


def test_warmup_then_linear():
    s = LRScheduler(1.0, 0.1, warmup_steps=10, decay_steps=110, decay_style="linear")
    assert s.lr_at(0) == 0.0 and s.lr_at(5) == 0.5 and s.lr_at(10) == 1.0
    assert s.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s.lr_at(110) == pytest.approx(0.1) and s.lr_at(500) == 0.1


def test_cosine_midpoint_and_end():
    s = LRScheduler(2.0, 0.0, warmup_steps=0, decay_steps=100, decay_style="cosine")
    assert s.lr_at(50) == pytest.approx(1.0)
    assert s.lr_at(100) == pytest.approx(0.0, abs=1e-12)


def test_constant_and_inverse_sqrt():
    assert LRScheduler(1.0, 0.0, 5, 100, "constant").lr_at(80) == 1.0
    s = LRScheduler(1.0, 0.01, 4, 100, "inverse-square-root")
    assert s.lr_at(16) == pytest.approx(math.sqrt(4) / math.sqrt(16))


@pytest.mark.parametrize("style,mid", [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1),
                                       ("minus_sqrt", 1 - 0.5 ** 0.5)])
def test_wsd_stable_then_anneal(style, mid):
    s = LRScheduler(1.0, 0.0, warmup_steps=0, decay_steps=100, decay_style="WSD", wsd_decay_steps=20,
                    wsd_decay_style=style)
    assert s.lr_at(80) == 1.0
    assert s.lr_at(90) == pytest.approx(mid)
    assert s.lr_at(100) == pytest.approx(0.0, abs=1e-12)


def test_state_round_trip():
    s = LRScheduler(1.0, 0.0, 10, 100, "cosine")
    s.step(37)
    t = LRScheduler(1.0, 0.0, 10, 100, "cosine")
    t.load_state_dict(s.state_dict())
    assert t.lr == s.lr
