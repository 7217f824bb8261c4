"""kernels.cpu.moe's gating against a numpy model of llama.cpp's ops (kernels.reference); the whole
mixture-of-experts layer is compared with llama.cpp itself in tests/engine/test_tiny_models.py."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.cpu.moe import route
from kernels.reference import moe_route_ref


def _route(logits, k, norm=True):
    sel, wts = np.empty((len(logits), k), np.int64), np.empty((len(logits), k), np.float32)
    for r in range(len(logits)):
        route(logits[r], k, norm, sel[r], wts[r])
    return sel, wts


@pytest.mark.parametrize("n_expert,n_used", [(8, 2), (60, 4), (128, 8), (40, 8)])
def test_route_is_ggml_softmax_top_k_and_normalized_weights(n_expert, n_used):
    """Bit for bit, with an expert count that leaves a tail beyond whole 8-lane steps (60: Qwen1.5-MoE's)."""
    logits = np.random.default_rng(n_expert).normal(0, 3, size=(64, n_expert)).astype(np.float32)
    sel, wts = _route(logits, n_used)
    ref_sel, ref_wts = moe_route_ref(logits, n_used)
    np.testing.assert_array_equal(sel, ref_sel)
    np.testing.assert_array_equal(wts.view(np.int32), ref_wts.view(np.int32))
    np.testing.assert_allclose(wts.sum(axis=1), 1.0, rtol=1e-6)


def test_route_without_normalizing_keeps_the_softmax_probabilities():
    logits = np.random.default_rng(3).normal(0, 2, size=(16, 32)).astype(np.float32)
    sel, wts = _route(logits, 4, norm=False)
    ref_sel, ref_wts = moe_route_ref(logits, 4, norm_weights=False)
    np.testing.assert_array_equal(sel, ref_sel)
    np.testing.assert_array_equal(wts, ref_wts)
    assert (wts.sum(axis=1) < 1).all()


def test_equal_probabilities_take_the_lower_expert_first():
    """Ties (std::sort's insertion sort keeps them in index order for the short rows it sorts)."""
    logits = np.zeros((1, 8), np.float32)
    logits[0, [2, 5, 6]] = 1.0
    sel, wts = _route(logits, 3)
    assert sel.tolist() == [[2, 5, 6]]
    assert wts[0, 0] == wts[0, 1] == wts[0, 2]
