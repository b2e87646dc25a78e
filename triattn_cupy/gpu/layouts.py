"""How the projection stores q, k, v, the gate and the pair bias for the attention kernel
that reads them: one `Layout` per form, defined once here.

Each layout knows its element types, whether k, v and the bias live in 64-key tiles after
qkvg, how many words a qkvg row takes and how many bytes a tile, and emits the feature
`#define`s that the projection kernels test (kernels/project_epilogue.cuh,
kernels/project_wgmma.cu; every feature defaults to 0 there, the fp32 rows).

    name             q / k / v              gate   bias         qkvg row   read by
    rows_fp32        fp32 rows              fp32   fp32         4D words   attention_ffma, attention_mma f16x3
    rows_tf32        fp32 q, k, v as TF32   fp32   fp32         4D         attention_mma tf32
    rows_bf16        bf16 (k, v packed)     bf16   fp16         4D         attention_mma bf16
    tiles_bf16       bf16 q; K, V^T tiles   bf16   fp16 tiles   D (slots)  attention_wgmma bf16
    tiles_f16_hilo   fp16 hi + lo, scaled   fp32   fp16 hi + lo 2D         attention_wgmma f16x3
    tiles_f16        fp16, scaled           fp32   fp16 tiles   2D         attention_wgmma f16, f16s
    tiles_f16_slots  fp16, scaled           bf16   fp16 tiles   D (slots)  attention_wgmma f16s

"Scaled": q, k, v and the bias multiplied by powers of two into fp16's range (scales.py);
"slots": q and the gate in each head's 32-word slot of a row of D words.
"""
from __future__ import annotations

import dataclasses

# Bytes of one K tile plus its V^T tile per (b, i, head, 64 keys) in 16 bits: 64 keys x 32
# dims each (head dim 32, the only one the tiled layouts serve).
_TILE_BYTES_16 = 2 * 64 * 32 * 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """One form of the projection's output (the module docstring's table).

    qkv, gate, bias: element types ("fp32", "tf32", "bf16", "fp16", "fp16 hi+lo");
    tiled: k, V^T and the pair bias in 64-key tiles (wgmma operands, 128-byte swizzle)
    after qkvg, the bias in [128 queries][64 keys] tiles; row_words: qkvg words per row in
    units of D; tile_bytes: K and V^T tile bytes per (b, i, head, 64 keys) (0: untiled);
    o16: the attention writes o in 16 bits ("bf16", or "fp16" in v's units) over each
    head's first 16 words, else fp32 over [0, D); scaled: q, k, v and the bias come
    multiplied by powers of two into fp16's range; features: the kernels' #defines."""
    name: str
    qkv: str
    gate: str
    bias: str
    tiled: bool = False
    row_words: int = 4
    tile_bytes: int = 0
    o16: str | None = None
    scaled: bool = False
    features: tuple[str, ...] = ()

    def defines(self) -> tuple[tuple[str, int], ...]:
        """The feature #defines of the projection kernels writing (or, for the out
        projection, reading) this layout."""
        return tuple((feature, 1) for feature in self.features)

    @property
    def slot_rows(self) -> bool:
        """q (then o) and the gate in each head's 32-word slot of a row of D words."""
        return self.row_words == 1

    def __repr__(self):
        return f"Layout({self.name})"


# The features (#defines, 1 where set):
#   KV_TILED      k, V^T and the pair bias in 64-key tiles after qkvg
#   QG_PACKED     q and the gate packed bf16
#   KV_BF16_ROWS  k and v packed bf16 in the rows (from column D)
#   KV_TF32       k and v rounded to TF32 where stored
#   F16_QKV       q, k, v scaled into fp16, qkvg rows of 2D words (the gate fp32 after q)
#   SLOT_ROWS     rows of D words: q and the gate in each head's 32-word slot
#   HI_LO         q, k, v and the bias as fp16 hi and lo parts
#   BIAS_F16      the pair bias in fp16
#   O16           the attention writes o in 16 bits (load_o4)
#   TILES_BF16    the tiles (and o) in bf16, else fp16
ROWS_FP32 = Layout("rows_fp32", "fp32", "fp32", "fp32")
ROWS_TF32 = Layout("rows_tf32", "tf32", "fp32", "fp32", features=("KV_TF32",))
ROWS_BF16 = Layout("rows_bf16", "bf16", "bf16", "fp16",
                   features=("QG_PACKED", "KV_BF16_ROWS", "BIAS_F16"))
TILES_BF16 = Layout("tiles_bf16", "bf16", "bf16", "fp16", tiled=True, row_words=1,
                    tile_bytes=_TILE_BYTES_16, o16="bf16",
                    features=("KV_TILED", "QG_PACKED", "SLOT_ROWS", "BIAS_F16", "O16",
                              "TILES_BF16"))
TILES_F16_HILO = Layout("tiles_f16_hilo", "fp16 hi+lo", "fp32", "fp16 hi+lo", tiled=True,
                        row_words=2, tile_bytes=2 * _TILE_BYTES_16, scaled=True,
                        features=("KV_TILED", "F16_QKV", "HI_LO", "BIAS_F16"))
TILES_F16 = Layout("tiles_f16", "fp16", "fp32", "fp16", tiled=True, row_words=2,
                   tile_bytes=_TILE_BYTES_16, o16="fp16", scaled=True,
                   features=("KV_TILED", "F16_QKV", "BIAS_F16", "O16"))
# Written by project_wgmma.cu only (project_mma.cu has no slot rows in fp16)
TILES_F16_SLOTS = Layout("tiles_f16_slots", "fp16", "bf16", "fp16", tiled=True, row_words=1,
                         tile_bytes=_TILE_BYTES_16, o16="fp16", scaled=True,
                         features=("KV_TILED", "SLOT_ROWS", "BIAS_F16"))

LAYOUTS = (ROWS_FP32, ROWS_TF32, ROWS_BF16, TILES_BF16, TILES_F16_HILO, TILES_F16,
           TILES_F16_SLOTS)
BY_NAME = {layout.name: layout for layout in LAYOUTS}
