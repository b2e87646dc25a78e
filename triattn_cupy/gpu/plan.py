"""The launches of a forward pass over one input geometry, worked out once (Plan)."""
from __future__ import annotations

import math

import numpy as np

from .._checks import pair_geometry
from .launch import Call, Launch, Signature

from . import layouts
from . import routes
from . import tiles
from .device_weights import DeviceWeights
from .scales import LOG2E


# The kernels' parameters, in their order (kernels/*.cu)
_MASK = Signature("ptr mask", "i32 mask_kind", "i64 mb", "i64 mi", "i64 mj")
LN_QKVG_PROJECT = Signature(
    "ptr x", "i64 sb", "i64 si", "i64 sj", "i64 sc", "i32 x_vec", "i32 B", "i32 N", "i32 D",
    "i32 H", "f32 eps", "f32 q_scale", "ptr gamma", "ptr beta", "ptr W", "ptr b_qkvg",
    "ptr Wb") + _MASK + Signature("ptr qkvg", "ptr bias", "i32 npk", "ptr vt")
F16_TERMS_ARGS = Signature("f32 a_scale", "f32 unscale")  # (project_mma.cu F16_TERMS)
GATED_OUT_PROJECT = Signature("ptr qkvg", "i64 M", "i32 D", "ptr W", "ptr b_out", "ptr out")
LN_QKVG_PROJECT_TILES = Signature(
    "ptr x", "i64 sb", "i64 si", "i64 sj", "i32 B", "i32 N", "i32 H", "f32 eps",
    "ptr gamma_beta", "ptr w_image", "ptr col_bias", "f32 q_scale", "f32 unscale"
    ) + _MASK + Signature("ptr qkvg", "ptr bias", "i32 npk", "ptr vt")
SPLIT_TILES_ARGS = Signature("ptr wb", "f32 a_unscale")  # (project_wgmma_split.cu)
GATED_OUT_PROJECT_TILES = Signature("ptr qkvg", "i64 M", "ptr wo_image", "ptr b_out", "ptr out",
                                    "f32 w_unscale")
ATTENTION = Signature("ptr qkvg", "ptr bias", "i32 B", "i32 N", "i32 H", "i32 npk",
                      "i32 nan_fully_masked")
MASK_KEY_EXTENT = _MASK + Signature("i32 N", "i32 chunks", "ptr key_extent")
ROW_MASK_PACK = _MASK + Signature("i32 B", "i32 N", "i32 words_per_row", "ptr row_mask")


class Plan:
    """The launches of a forward pass over one input geometry: pair shape and strides,
    alignment, mask dtype and strides, precision and fully-masked policy, built from its
    Route (routes.choose_route decides; nothing is decided here). Made once per module and
    geometry (Forward keeps them in DeviceWeights.plans): at small sizes the host time
    before the first kernel starts is what the caller waits for. Stages, in order:
    `project`, `attention`, `out_project`, each a Launch taking the pointers pair, mask,
    qkvg, bias, vt, extent and out."""

    def __init__(self, dw: DeviceWeights, shape, strides, aligned: bool, mask_meta,
                 precision: str, nan_fully_masked: bool,
                 attention: "routes.AttentionLaunch | None" = None,
                 route: "routes.Route | str | None" = None, out_transposed: bool = False,
                 row_mask: bool = False, pair_dtype: str = "float32"):
        B, N, _ = pair_geometry(shape, dw.pair_dim)
        D, H, d = dw.pair_dim, dw.num_heads, dw.head_dim
        self._qkv_scales = dw.qkv_scales
        self._f16x3_scales = dw.f16x3_scales  # what attention_mma_f16x3 scales q, k, v by itself
        self.B, self.N, self.D, self.H, self.d = B, N, D, H, d
        self.M = M = B * N * N
        sb, si, sj, sc = strides if len(strides) == 4 else (0, *strides)
        # The pair's elements: float32, or 16 bits (PAIR_DTYPE: read as that, the output
        # written as that)
        self.pair_dtype = pair_dtype
        per_16_bytes = 4 if pair_dtype == "float32" else 8
        # The pair's rows contiguous and 16-byte aligned: vector loads (x_vec), and the
        # persistent LayerNorm projection, which copies whole rows
        x_vec = int(sc == 1 and all(s % per_16_bytes == 0 for s in (sb, si, sj)) and aligned)
        self.strides, self.x_vec = (sb, si, sj, sc), x_vec  # (row_blocks' bias pass)
        geometry = dict(rows_aligned=bool(x_vec), smem_limit=dw.smem_limit,
                        masked=mask_meta is not None)
        if attention is not None:  # one attention kernel forced (tile sweeps and tests)
            if route is not None:
                raise ValueError("give route= or attention=, not both")
            self.route = routes.route_for_attention(attention, precision, D, N,
                                                    dw.compute_capability, **geometry)
        else:
            self.route = routes.choose_route(
                precision, d, D, N, dw.compute_capability, f16s_scales=dw.qkv_scales["f16s"]
                is not None, force=route, **geometry)
        r = self.route
        if r.scales == "f16s" and dw.qkv_scales["f16s"] is None:
            raise ValueError(f"route {r.name!r} needs these weights' scores inside fp16's "
                             f"range (scales.f16s_scales: their bound passes 2^15 in log2 "
                             f"units); use another route")
        self.attention_kernel = attention or r.attention_launch(d, N)
        self.layout = layout = r.layout
        self.project_mma = r.project != "ffma"
        self.project_split = r.products == "f16x3"
        self.project_f16 = r.products in ("f16", "f16x3")  # fp16 products (F16_TERMS)
        # The key axis of the bias is padded with -inf to whole key tiles of either
        # attention kernel (at most BIAS_KEY_ALIGN keys; the tensor-core kernel copies
        # whole tiles).
        self.npk = -(-N // tiles.BIAS_KEY_ALIGN) * tiles.BIAS_KEY_ALIGN
        # qkvg rows of 4D, 2D or D words (layouts.Layout.row_words; project_epilogue.cuh
        # QKVG_LD)
        row_words = layout.row_words * D
        self.qkvg_shape, self.bias_shape = (M, row_words), (B, H, N, self.npk)
        # The scratch arrays in one pool allocation, the bias after qkvg (M * 8D bytes at
        # least: a multiple of 32, so the bias starts 16-byte aligned for its tile copies).
        self.qkvg_bytes = M * row_words * 4
        self.bias_dtype = np.float32 if layout.bias == "fp32" else np.float16
        if layout.tiled:  # [B, H, query tiles, key tiles] x [128 queries][64 keys], rows
            # swizzled (project_epilogue.cuh bias_element); hi and lo tiles for HI_LO
            q_tiles = -(-N // tiles.WGMMA_QUERIES)
            self.bias_shape = (B, H, q_tiles, self.npk // tiles.WGMMA_KEYS,
                               tiles.WGMMA_QUERIES, tiles.WGMMA_KEYS)
            if layout == layouts.TILES_F16_HILO:
                self.bias_shape = self.bias_shape[:4] + (2,) + self.bias_shape[4:]
        self.bias_bytes = math.prod(self.bias_shape) * np.dtype(self.bias_dtype).itemsize
        # The bias tiles' rows past N in the last query tile belong to no pair row, so the
        # projection never writes them; the wgmma attention still reads them into its
        # padded queries, and its row-shared decisions let them move the kept queries'
        # rounding. Zeroed before each projection, so that a call never depends on what an
        # earlier one left in the pool (the same bits on every stream and thread).
        self.zero_bias = layout.tiled and N % tiles.WGMMA_QUERIES != 0
        # The K and V^T tiles after the bias, per (b, i, head, 64 keys) (a multiple of 256
        # bytes from the start: 16-byte aligned for the tile copies)
        self.vt_bytes = B * N * H * (self.npk // tiles.WGMMA_KEYS) * layout.tile_bytes
        self.scratch_bytes = self.qkvg_bytes + self.bias_bytes + self.vt_bytes
        # Each batch's key extent under the mask (key_extent.cu; B ints after the rest),
        # where the attention's key loops may stop early.
        self.key_extent = None
        if r.key_extent:
            chunks = routes.key_extent_chunks(N)
            self.key_extent = Launch(
                routes.key_extent_config(), "mask_key_extent", chunks * B,
                routes.KEY_EXTENT_THREADS, 0,
                MASK_KEY_EXTENT.bind(**_mask_args(mask_meta), N=N, chunks=chunks,
                                     key_extent=Call("extent")))
            self.extent_offset = self.scratch_bytes
            self.scratch_bytes += 4 * B
        # The ending node: the out projection writes row (b, i, j) of the transposed pair
        # to the caller's row (b, j, i) (OUT_TRANSPOSED; its kernels take N last)
        self.out_transposed = out_transposed
        # The row mask layout: the projection folds no mask into the bias (its mask is
        # indexed by the row i, which the bias shared by every row cannot hold);
        # row_mask_pack packs it into key bits per row (b, i), B N npk / 32 words after the
        # rest, which the attention applies (ROW_MASK). The key extent reads the mask as is:
        # the same reduction over its middle axis.
        self.row_mask = None
        projection_mask = mask_meta
        if row_mask:
            if mask_meta is None:
                raise ValueError("row_mask needs a mask")
            projection_mask = None
            words = self.npk // 32
            count = B * N * words
            self.row_mask = Launch(
                routes.row_mask_config(), "row_mask_pack",
                -(-count // routes.ROW_MASK_THREADS), routes.ROW_MASK_THREADS, 0,
                ROW_MASK_PACK.bind(**_mask_args(mask_meta), B=B, N=N, words_per_row=words,
                                   row_mask=Call("row_mask")))
            self.row_mask_offset = self.scratch_bytes
            self.scratch_bytes += 4 * count
        self.projection_mask = projection_mask  # (the mask the projection folds in)
        self.tiles = r.out_project == "tiles"
        self.project_tiles = r.project == "tiles"
        if self.project_tiles:
            self.project = self._tiles_projection(dw, projection_mask, sb, si, sj)
        else:
            rows = tiles.project_rows(D, M, dw.sm_count, dw.smem_limit, self.project_mma)
            signature = LN_QKVG_PROJECT + (F16_TERMS_ARGS if self.project_f16 else Signature())
            self.project = Launch(
                routes.project_config(rows, r.project, D, layout, r.products, pair_dtype),
                f"ln_qkvg_project_{r.project}_{r.products}", -(-M // rows),
                tiles.PROJECT_THREADS,
                tiles.project_smem_bytes(D, rows, self.project_mma),
                signature.bind(
                    x=Call("pair"), sb=sb, si=si, sj=sj, sc=sc, x_vec=x_vec, B=B, N=N, D=D, H=H,
                    eps=dw.eps, q_scale=LOG2E / math.sqrt(d), gamma=dw.gamma.data.ptr,
                    beta=dw.beta.data.ptr,
                    W=dw.projection_weight("qkvg", self.weight_layout, self.scales).data.ptr,
                    b_qkvg=dw.qkvg_bias(self.scales).data.ptr,
                    Wb=dw.bias_weight(self.project_f16, self.scales).data.ptr,
                    **_mask_args(projection_mask), qkvg=Call("qkvg"), bias=Call("bias"),
                    npk=self.npk, vt=Call("vt"), **self._f16_projection_args(dw)))
        self.attention = self.attention_launch(self.attention_kernel, nan_fully_masked)
        # Rows per out-projection block (its tiles: a row block must start one, row_blocks)
        out_rows = tiles.out_project_rows(M, dw.sm_count, r.out_project == "mma")
        self.out_rows = tiles.TILES_ROWS if self.tiles else out_rows
        if self.tiles:
            self.out_project = self._tiles_out_projection(dw)
        else:
            signature = GATED_OUT_PROJECT + (Signature("f32 w_unscale") if self.project_f16
                                             else Signature())
            config = routes.project_config(out_rows, r.out_project, D, layout, r.products,
                                           pair_dtype)
            transposed = {}
            if out_transposed:
                config = routes.out_transposed(config)
                signature, transposed = signature + Signature("i32 N"), dict(N=N)
            self.out_project = Launch(
                config,
                f"gated_out_project_{r.out_project}_{r.products}", -(-M // out_rows),
                tiles.PROJECT_THREADS,
                tiles.project_smem_bytes(D, out_rows, self.project_mma),
                signature.bind(
                    qkvg=Call("qkvg"), M=M, D=D,
                    W=dw.projection_weight("out", self.weight_layout, self.scales).data.ptr,
                    b_out=dw.b_out.data.ptr, out=Call("out"),
                    **self._f16_projection_args(dw, out=True), **transposed),
                dependent=True)
        self.nan_fully_masked = nan_fully_masked


    def _tiles_projection(self, dw: DeviceWeights, mask_meta, sb, si, sj) -> "Launch":
        """ln_qkvg_project_wgmma: one block per SM over the tiles of 64 keys (b, i, 64c ..),
        its weights resident (DeviceWeights.tile_weight_image); the split kernel (fp32
        mode) also takes the pair-bias weights in fp32 and 1 / a_scale."""
        B, N, H, d = self.B, self.N, self.H, self.d
        s = dw.f16_scales(self.scales)
        split = tiles.project_tiles_split(self.layout)
        n_tiles = B * N * -(-N // tiles.TILES_ROWS)
        smem = tiles.project_tiles_smem_bytes(self.layout)
        signature = LN_QKVG_PROJECT_TILES + (SPLIT_TILES_ARGS if split else Signature())
        extra = (dict(wb=dw.bias_weight(False, self.scales).data.ptr, a_unscale=1.0 / s.a)
                 if split else {})
        return Launch(
            routes.project_tiles_config(self.layout, self.pair_dtype),
            "ln_qkvg_project_wgmma_" + ("f16x3" if split else "f16"),
            min(n_tiles, dw.sm_count), tiles.TILES_THREADS, smem,
            signature.bind(
                x=Call("pair"), sb=sb, si=si, sj=sj, B=B, N=N, H=H, eps=dw.eps,
                gamma_beta=dw.tile_gamma_beta(s.a).data.ptr,
                w_image=dw.tile_weight_image("qkvg", self.scales, split).data.ptr,
                col_bias=dw.qkvg_bias(self.scales).data.ptr,
                q_scale=LOG2E / math.sqrt(d), unscale=1.0 / (s.a * s.w),
                **_mask_args(mask_meta), qkvg=Call("qkvg"), bias=Call("bias"), npk=self.npk,
                vt=Call("vt"), **extra))

    def _tiles_out_projection(self, dw: DeviceWeights) -> "Launch":
        """gated_out_project_wgmma: one block per SM over the tiles of 64 rows, Wo resident."""
        n_tiles = -(-self.M // tiles.TILES_ROWS)
        split = tiles.project_tiles_split(self.layout)
        config, signature, transposed = (routes.project_tiles_config(self.layout,
                                                                     self.pair_dtype),
                                         GATED_OUT_PROJECT_TILES, {})
        if self.out_transposed:  # (the ending node: OUT_TRANSPOSED, N last)
            config = routes.out_transposed(config)
            signature, transposed = signature + Signature("i32 N"), dict(N=self.N)
        return Launch(
            config,
            "gated_out_project_wgmma_" + ("f16x3" if split else "f16"),
            min(n_tiles, dw.sm_count), tiles.TILES_THREADS,
            tiles.project_tiles_smem_bytes(self.layout, out=True),
            signature.bind(
                qkvg=Call("qkvg"), M=self.M,
                wo_image=dw.tile_weight_image("out", split=split).data.ptr,
                b_out=dw.b_out.data.ptr, out=Call("out"),
                **self._f16_projection_args(dw, out=True), **transposed),
            dependent=True)

    def _f16_projection_args(self, dw: DeviceWeights, out: bool = False) -> dict:
        """The fp16 products' last arguments of ln_qkvg_project, a_scale and unscale (or
        `out`: gated_out_project's w_unscale); none otherwise."""
        if not self.project_f16:
            return {}
        s = dw.f16_scales(self.scales)
        if out:  # the kernel scales each block's g o itself (load_gated_tile_f16); o comes
            # in v's units where the attention writes it in fp16 (O16)
            o_unit = self.scales[2] if self.layout.o16 == "fp16" else 1.0
            return {"w_unscale": 1.0 / (s.out_w * o_unit)}
        return {"a_scale": s.a, "unscale": 1.0 / (s.a * s.w)}

    @property
    def scales(self):
        """(s_q, s_k, s_v, s_b): the powers of two q, k, v and the pair bias come scaled by
        into fp16's range (the route's scales: DeviceWeights.qkv_scales), or None."""
        return self._qkv_scales.get(self.route.scales)

    def attention_launch(self, k: "routes.AttentionLaunch", nan_fully_masked: bool):
        if k.layout != self.layout:
            raise ValueError(f"launch {k.name} reads the layout {k.layout.name}, but this "
                             f"forward's projection writes {self.layout.name}; build the "
                             f"Forward with attention=that launch")
        if (k.name == "attention_wgmma_f16s") != (self.route.scales == "f16s"):
            raise ValueError(f"launch {k.name} reads q, k and the bias scaled otherwise than "
                             f"this forward's projection scales them ({self.route.scales!r}); "
                             f"build the Forward with attention=that launch")
        signature, values = ATTENTION, dict(qkvg=Call("qkvg"), bias=Call("bias"), B=self.B,
                                            N=self.N, H=self.H, npk=self.npk,
                                            nan_fully_masked=int(nan_fully_masked))
        if k.layout.tiled:  # and v (and k) from the tiles
            signature += Signature("ptr vt")
            values["vt"] = Call("vt")
        if k.layout.scaled:  # undo the projection's scales
            s_q, s_k, s_v, _ = self.scales
            signature += Signature("f32 qk_unscale", "f32 v_unscale")
            values.update(qk_unscale=1.0 / (s_q * s_k), v_unscale=1.0 / s_v)
        if k.operand_scales:  # the kernel scales fp32 q, k, v into fp16's range itself
            signature += Signature("f32 s_q", "f32 s_k", "f32 s_v")
            values.update(zip(("s_q", "s_k", "s_v"), self._f16x3_scales))
        signature += Signature("ptr key_extent")  # (null: all N keys)
        values["key_extent"] = Call("extent")
        config, smem = k.config, k.smem
        if self.row_mask is not None:  # (ROW_MASK: the key bits last)
            config = routes.row_masked(config)
            signature += Signature("ptr row_mask")
            values["row_mask"] = Call("row_mask")
            smem += routes.row_mask_smem_bytes(k, self.npk)
        return Launch(config, k.name, k.blocks(self.B, self.N, self.H), k.threads, smem,
                      signature.bind(**values), dependent=True)

    @property
    def weight_layout(self) -> str:
        """The projection weights' layout this forward's kernels read (projection_weight):
        transposed for FFMA, in fp16 hi and lo chunks for the split fp16 products
        (F16_TERMS 3), in fp16 hi chunks for one fp16 product (F16_TERMS 1), in chunks
        rounded to TF32 for TF32."""
        if not self.project_mma:
            return "transposed"
        if self.project_f16:
            return "f16 chunks" if self.project_split else "f16 hi chunks"
        return "tf32 chunks"


def plan_key(pair, mask, precision: str, nan_fully_masked: bool, route=None,
             out_transposed: bool = False, row_mask: bool = False,
             pair_dtype: str = "float32"):
    """The key of DeviceWeights.plans: what a Plan depends on, as the arrays give it
    (byte strides; the mask's dtype and byte strides), cheap to build at every call.
    The conventions (`out_transposed`: the ending node; `row_mask`: a mask in the row
    layout) and a 16-bit `pair_dtype` only where set, so that the other keys are those of
    the trees before them."""
    key = (pair.shape, pair.strides, pair.data.ptr % 16 == 0,
           None if mask is None else (mask.dtype, mask.strides), precision, nan_fully_masked,
           route)
    if pair_dtype != "float32":
        return key + ((out_transposed, row_mask, pair_dtype),)
    return key + ((out_transposed, row_mask),) if out_transposed or row_mask else key


def make_plan(dw: "DeviceWeights", key, attention: "routes.AttentionLaunch | None" = None):
    """The Plan of a plan_key (pair strides in elements, the mask's meta)."""
    shape, strides, aligned, mask_key, precision, nan_fully_masked, route, *conventions = key
    out_transposed, row_mask, *pair_dtype = conventions[0] if conventions else (False, False)
    pair_dtype = pair_dtype[0] if pair_dtype else "float32"
    itemsize = 4 if pair_dtype == "float32" else 2
    return Plan(dw, shape, tuple(s // itemsize for s in strides), aligned,
                _mask_meta(mask_key), precision, nan_fully_masked, attention, route,
                out_transposed=out_transposed, row_mask=row_mask, pair_dtype=pair_dtype)


def _mask_meta(mask_key):
    """What of the mask a plan depends on, from plan_key's (dtype, byte strides): None, or
    (itemsize, is float, strides in elements over (B, N, N))."""
    if mask_key is None:
        return None
    dtype, byte_strides = mask_key
    strides = tuple(s // dtype.itemsize for s in byte_strides)
    return (dtype.itemsize, dtype.kind == "f", strides if len(strides) == 3 else (0, *strides))


def _mask_args(meta) -> dict:
    """The mask's arguments (the call's pointer; kind, mb, mi, mj for project_math.cuh's
    mask reader, MASK_* codes)."""
    if meta is None:  # a null pointer
        return dict(mask=Call("mask"), mask_kind=0, mb=0, mi=0, mj=0)
    itemsize, is_float, strides = meta
    kind = 5 + {2: 0, 4: 1, 8: 2}[itemsize] if is_float else {1: 1, 2: 2, 4: 3, 8: 4}[itemsize]
    return dict(mask=Call("mask"), mask_kind=kind, **dict(zip(("mb", "mi", "mj"), strides)))
