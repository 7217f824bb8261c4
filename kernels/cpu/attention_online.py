"""Paged attention with an online softmax (flash attention, flash-decoding): the alternative to
attention.py's llama.cpp softmax, chosen with softmax="online" there.

Prefill: query tiles x KV blocks, each row keeping a running max m and sum l and rescaling its
partial output when m moves, so a tile holds one block of scores at a time. Decode: work items
(kv head, split of the keys) leave unnormalised (output, max, sumexp) partials, merged by
log-sum-exp. Probabilities stay float32 (llama.cpp rounds them to float16), so this path is the
more accurate of the two and llama.cpp's tokens are the other path's to match. Layouts and the
visibility rule are attention.py's.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.attention_tiles import dec_qk16, decode_pv, prefetch_rows, tile_pv, tile_scores, widen_rows16
from kernels.cpu.ops import f16_value, serial_twin, soft_cap, vexp

FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}  # no nnan/ninf: -inf marks masked scores


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _update_max(m, l, alpha, R):
    """alpha holds each row's new running max: move it into m, leave in alpha the factor that
    rescales the row's old sum and output, scale l. Returns whether any factor differs from 1
    (once the max has settled, none does and the output needs no rescaling)."""
    n_changed = 0
    for i in range(R):
        m_new = alpha[i]
        m_ref = m_new if m_new > -np.inf else np.float32(0.0)  # row with nothing visible yet
        a = vexp(m[i] - m_ref) if m[i] > -np.inf else np.float32(0.0)
        n_changed += a != np.float32(1.0)
        alpha[i] = a
        m[i] = m_new
        l[i] *= a
    return n_changed > 0


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _rescale(acct, alpha):
    for e in range(acct.shape[0]):
        arow = acct[e]
        for i in range(acct.shape[1]):
            arow[i] *= alpha[i]


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _soft_cap(st, n, cap):
    """gemma2's soft-capping of scores st[:n] (rows of lanes) in place. The scores here already
    carry the attention scale (the queries are scaled), so cap is scale * softcap: scale * softcap *
    tanh(s / softcap) of the unscaled score s, which is what the softmax then sees."""
    for jj in range(n):
        soft_cap(st[jj], 0, st.shape[1], cap)


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _attend_tile_online(qt, kf, vf, kstride, block_table, bs, kvh, pos, lo_pos, pos_min, lo_max, n_keys_lo,
                 n_keys_hi, m, l, acct, st, alpha, kbuf, vbuf, cap):
    """Prefill: online-softmax update of R query rows over keys [n_keys_lo, n_keys_hi).
    cap > 0: the (scaled) scores soft-capped, cap * tanh(s / cap) (_soft_cap).

    The R rows (positions x the GQA group, padded to a multiple of 16) are the vector lanes:
    qt (hd, R) holds the scaled queries, st (bs, R) the scores of one cache block, acct (hd, R)
    the unnormalised output. Scores and P@V run in the register-blocked micro-kernels, each
    loaded K/V element serving 16-64 rows; the softmax bookkeeping (mask, max, exp, rescale) is
    elementwise over R. kf/vf: the layer's float16 K/V cache (uint16 bits) flattened from
    (n_blocks, bs, Hkv, hd), so key (blk, off) of head kvh starts at ((blk*bs + off)*Hkv + kvh)*hd
    and kstride = Hkv*hd; each block's rows are widened once into kbuf/vbuf (bs*hd float32).
    pos/lo_pos (R,): a row at position p sees keys lo_pos <= j <= p (padding rows: none);
    pos_min / lo_max: the least p and the largest lo_pos of the real rows.
    """
    hd, R = qt.shape
    j0 = n_keys_lo
    while j0 < n_keys_hi:
        blk = block_table[j0 // bs]
        off0 = j0 % bs
        j1 = min(n_keys_hi, j0 - off0 + bs)
        n = j1 - j0
        base = (blk * bs + off0) * kstride + kvh * hd
        if hd % 16 == 0:
            widen_rows16(kf, base, kstride, n, hd, kbuf)
            widen_rows16(vf, base, kstride, n, hd, vbuf)
        else:
            for jj in range(n):
                for e in range(hd):
                    kbuf[jj * hd + e] = f16_value(kf[base + jj * kstride + e])
                    vbuf[jj * hd + e] = f16_value(vf[base + jj * kstride + e])
        tile_scores(qt, kbuf, 0, hd, st, n)
        if cap > 0:
            _soft_cap(st, n, cap)
        # new running max (alpha holds it for now)
        for i in range(R):
            alpha[i] = m[i]
        if j0 >= lo_max and j1 - 1 <= pos_min:
            # every row sees every key of the block (most of a long history): no mask, and each
            # visible score takes exactly the arithmetic of the masked path below
            for jj in range(n):
                srow = st[jj]
                for i in range(R):
                    alpha[i] = max(alpha[i], srow[i])
            rescale = _update_max(m, l, alpha, R)
            if rescale:
                _rescale(acct, alpha)
            for jj in range(n):
                srow = st[jj]
                for i in range(R):
                    pv = vexp(srow[i] - m[i])
                    srow[i] = pv
                    l[i] += pv
        else:
            # masked scores become -inf
            for jj in range(n):
                j = j0 + jj
                srow = st[jj]
                for i in range(R):
                    sv = srow[i] if (j <= pos[i] and j >= lo_pos[i]) else np.float32(-np.inf)
                    srow[i] = sv
                    alpha[i] = max(alpha[i], sv)
            rescale = _update_max(m, l, alpha, R)
            if rescale:
                _rescale(acct, alpha)
            for jj in range(n):
                srow = st[jj]
                for i in range(R):
                    m_ref = m[i] if m[i] > -np.inf else np.float32(0.0)
                    pv = vexp(srow[i] - m_ref) if srow[i] > -np.inf else np.float32(0.0)
                    srow[i] = pv
                    l[i] += pv
        tile_pv(st, vbuf, 0, hd, n, acct)
        j0 = j1


@njit(fastmath=FAST, cache=True, error_model="numpy", inline="always")
def _prefill_tile_online(q, kf, vf, Hkv, bs, block_table, q_start, scale, softcap, window, kvh, t0, t1, out):
    """Query positions t0..t1-1 of kv head kvh's group: gather the rows, attend, normalise."""
    T, Hq, hd = q.shape
    G = Hq // Hkv
    R = (t1 - t0) * G
    Rp = (R + 15) // 16 * 16                # lanes: rows padded to whole vectors
    qt = np.zeros((hd, Rp), np.float32)     # column i = (t - t0) * G + g
    pos = np.full(Rp, -1, np.int64)         # padding rows see no key
    lo_pos = np.zeros(Rp, np.int64)
    for t in range(t0, t1):
        for g in range(G):
            i = (t - t0) * G + g
            for e in range(hd):
                qt[e, i] = q[t, kvh * G + g, e] * scale
            pos[i] = q_start + t
            lo_pos[i] = max(0, q_start + t - window + 1) if window > 0 else 0
    m = np.full(Rp, -np.inf, np.float32)
    l = np.zeros(Rp, np.float32)
    acct = np.zeros((hd, Rp), np.float32)
    st = np.empty((bs, Rp), np.float32)
    alpha = np.empty(Rp, np.float32)
    kbuf = np.empty(bs * hd, np.float32)
    vbuf = np.empty(bs * hd, np.float32)
    # keys from the block holding the tile's first visible key: every row then sees its keys
    # in the same groups whatever tile it is in (masked keys add exact zeros), so a row's
    # result does not depend on how the queries are chunked
    _attend_tile_online(qt, kf, vf, Hkv * hd, block_table, bs, kvh, pos, lo_pos, pos[0], lo_pos[R - 1],
                 lo_pos[0] - lo_pos[0] % bs, q_start + t1, m, l, acct, st, alpha, kbuf, vbuf, scale * softcap)
    for t in range(t0, t1):
        for g in range(G):
            i = (t - t0) * G + g
            inv = np.float32(1.0) / l[i]
            for e in range(hd):
                out[t, kvh * G + g, e] = acct[e, i] * inv


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def prefill_online(q, k_cache, v_cache, block_table, q_start, scale, softcap, window, q_tile, paired, out):
    """paired: each work item takes query tiles p and n_tiles-1-p of one kv head. Under the causal
    mask a tile's cost grows with its position, so the threads' contiguous shares of the work
    items then cost the same (one kv head's tiles in order left the last thread 1.4x the work)."""
    T = q.shape[0]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    n_tiles = (T + q_tile - 1) // q_tile
    n_items = (n_tiles + 1) // 2 if paired else n_tiles
    for w in prange(Hkv * n_items):
        kvh = w // n_items
        tile = w % n_items
        t0 = tile * q_tile
        _prefill_tile_online(q, kf, vf, Hkv, bs, block_table, q_start, scale, softcap, window, kvh, t0,
                             min(T, t0 + q_tile), out)
        mirror = n_tiles - 1 - tile
        if paired and mirror != tile:
            t0 = mirror * q_tile
            _prefill_tile_online(q, kf, vf, Hkv, bs, block_table, q_start, scale, softcap, window, kvh, t0,
                                 min(T, t0 + q_tile), out)


prefill_online_serial = serial_twin(prefill_online)


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def decode_partial_v(q, k_cache, v_cache, block_table, lo, hi, chunk, scale, softcap, o_part, m_part, l_part):
    """Split-KV decode (head_dim % 16 == 0): work item (kv head, split) attends the group's G query
    heads over keys [lo + split*chunk, ...) in chunks of up to 16 keys and leaves unnormalised
    (out, max, sumexp) for the merge. Scores: dec_qk16 (keys as lanes, products along head_dim,
    one shuffle reduction per head); P@V: dec_pv (head_dim as lanes). All keys seen are visible."""
    Hq, hd = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    kstride = Hkv * hd
    G = Hq // Hkv
    n_splits = m_part.shape[1]
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        sp = w % n_splits
        qg = np.empty((G, hd), np.float32)
        for g in range(G):
            for e in range(hd):
                qg[g, e] = q[kvh * G + g, e] * scale
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, hd), np.float32)
        s = np.empty((G, 16), np.float32)
        j0 = lo + sp * chunk
        j_end = min(hi, j0 + chunk)
        while j0 < j_end:
            off0 = j0 % bs
            j1 = min(j_end, j0 - off0 + bs, j0 + 16)
            n = j1 - j0
            base = (block_table[j0 // bs] * bs + off0) * kstride + kvh * hd
            jp = j1 + 16  # prefetch two chunks ahead (in place, 3.5k keys: attention -14% vs none)
            if jp < j_end:
                off1 = jp % bs
                n1 = min(j_end, jp - off1 + bs, jp + 16) - jp
                base1 = (block_table[jp // bs] * bs + off1) * kstride + kvh * hd
                prefetch_rows(kf, base1, kstride, n1, hd)
                prefetch_rows(vf, base1, kstride, n1, hd)
            dec_qk16(qg, kf, base, kstride, n, s)
            if softcap > 0:
                _soft_cap(s.T, n, scale * softcap)
            for g in range(G):
                sg = s[g]
                mx = m[g]
                for jj in range(n):
                    mx = max(mx, sg[jj])
                alpha = vexp(m[g] - mx)  # m = -inf on the first chunk: ~0
                lsum = l[g] * alpha
                for jj in range(n):
                    pv = vexp(sg[jj] - mx)
                    sg[jj] = pv
                    lsum += pv
                l[g] = lsum
                m[g] = mx
                if alpha != 1.0:
                    a = acc[g]
                    for e in range(hd):
                        a[e] *= alpha
            decode_pv(s, vf, base, kstride, n, acc)
            j0 = j1
        for g in range(G):
            m_part[kvh * G + g, sp] = m[g]
            l_part[kvh * G + g, sp] = l[g]
            o_part[kvh * G + g, sp, :] = acc[g, :]


@njit(parallel=True, fastmath=FAST, cache=True, error_model="numpy")
def decode_partial(q, k_cache, v_cache, block_table, lo, hi, chunk, scale, softcap, o_part, m_part, l_part):
    """Split-KV decode: work item (kv head, split) attends the group's G query heads over keys
    [lo + split*chunk, ...) and leaves unnormalised (out, max, sumexp) for the merge. Scores
    are dots over head_dim held as (G, bs) rows so the softmax is vectorized over keys."""
    Hq, hd = q.shape
    bs = k_cache.shape[1]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    n_splits = m_part.shape[1]
    for w in prange(Hkv * n_splits):
        kvh = w // n_splits
        sp = w % n_splits
        qg = np.empty((G, hd), np.float32)
        for g in range(G):
            for e in range(hd):
                qg[g, e] = q[kvh * G + g, e] * scale
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, hd), np.float32)
        s = np.empty((G, bs), np.float32)
        j0 = lo + sp * chunk
        j_end = min(hi, j0 + chunk)
        while j0 < j_end:
            blk = block_table[j0 // bs]
            off0 = j0 % bs
            j1 = min(j_end, j0 - off0 + bs)
            n = j1 - j0
            for jj in range(n):
                kr = k_cache[blk, off0 + jj, kvh]
                for g in range(G):
                    qr = qg[g]
                    dot = np.float32(0.0)
                    for e in range(hd):
                        dot += qr[e] * f16_value(kr[e])
                    s[g, jj] = dot
            if softcap > 0:
                _soft_cap(s.T, n, scale * softcap)
            for g in range(G):
                sg = s[g]
                mx = m[g]
                for jj in range(n):
                    mx = max(mx, sg[jj])
                alpha = vexp(m[g] - mx)  # m = -inf on the first block: ~0
                lsum = l[g] * alpha
                for jj in range(n):
                    pv = vexp(sg[jj] - mx)
                    sg[jj] = pv
                    lsum += pv
                l[g] = lsum
                m[g] = mx
                a = acc[g]
                for e in range(hd):
                    a[e] *= alpha
            for jj in range(n):
                vr = v_cache[blk, off0 + jj, kvh]
                for g in range(G):
                    pv = s[g, jj]
                    a = acc[g]
                    for e in range(hd):
                        a[e] += pv * f16_value(vr[e])
            j0 = j1
        for g in range(G):
            m_part[kvh * G + g, sp] = m[g]
            l_part[kvh * G + g, sp] = l[g]
            o_part[kvh * G + g, sp, :] = acc[g, :]


@njit(fastmath=FAST, cache=True, error_model="numpy")
def merge_splits(o_part, m_part, l_part, out):
    """Log-sum-exp merge of partial (unnormalised out, max, sumexp) per head."""
    Hq, S, hd = o_part.shape
    for h in range(Hq):
        mx = np.float32(-np.inf)
        for s in range(S):
            mx = max(mx, m_part[h, s])
        tot = np.float32(0.0)
        for e in range(hd):
            out[h, e] = 0.0
        for s in range(S):
            if m_part[h, s] == -np.inf:
                continue
            c = np.exp(m_part[h, s] - mx)
            tot += c * l_part[h, s]
            for e in range(hd):
                out[h, e] += c * o_part[h, s, e]
        inv = np.float32(1.0) / tot
        for e in range(hd):
            out[h, e] *= inv


decode_partial_serial = serial_twin(decode_partial)
decode_partial_v_serial = serial_twin(decode_partial_v)
