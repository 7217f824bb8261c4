"""What the exact kernels' type families share: how the per-block scale arrays are padded, and
how far ahead and in what chunks the kernels read."""

NB_PAD = 8                        # the per-block scale arrays are padded to a multiple of this
PREFETCH = 4096                   # decode reads each weight once per token: fetch this far ahead
# Activation rows per pass over W: the chunk (rows x K int8) stays in L2 while every weight group
# reads it; without it a prompt re-streams all its rows from L3 for each 8-row group.
X_CHUNK_BYTES = 192 << 10
