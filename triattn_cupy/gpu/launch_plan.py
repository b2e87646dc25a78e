"""The launches of a forward pass over one input geometry, worked out once (Plan).

PlanKey says what a plan depends on; Plan lays out the scratch and takes its launches from
RouteLaunches, the one place that builds a route's launches (configuration, grid, block,
shared memory, arguments by name), for the single pass and for row blocks alike.
"""
from __future__ import annotations

import math
import typing

import numpy as np

from .._checks import pair_geometry
from . import kernel_configs, layouts, routes, tiles
from .device_weights import DeviceWeights
from .launch import Call, Launch, Signature
from .scales import LOG2E


# The kernels' parameters, in their order (kernels/*.cu)
_MASK = Signature("ptr mask", "i32 mask_kind", "i64 mb", "i64 mi", "i64 mj")
LN_QKVG_PROJECT = Signature(
    "ptr x", "i64 sb", "i64 si", "i64 sj", "i64 sc", "i32 x_vec", "i32 B", "i32 N", "i32 D",
    "i32 H", "f32 eps", "f32 q_scale", "ptr gamma", "ptr beta", "ptr W", "ptr b_qkvg",
    "ptr Wb") + _MASK + Signature("ptr qkvg", "ptr bias", "i32 npk", "ptr vt")
F16_TERMS_ARGS = Signature("f32 a_scale", "f32 unscale")  # (project_mma.cu F16_TERMS)
GATED_OUT_PROJECT = Signature("ptr qkvg", "i64 M", "i32 D", "ptr W", "ptr b_out", "ptr out")
LN_QKVG_PROJECT_PERSISTENT = Signature(
    "ptr x", "i64 sb", "i64 si", "i64 sj", "i32 B", "i32 N", "i32 H", "f32 eps",
    "ptr gamma_beta", "ptr w_image", "ptr col_bias", "f32 q_scale", "f32 unscale"
    ) + _MASK + Signature("ptr qkvg", "ptr bias", "i32 npk", "ptr vt")
PERSISTENT_SPLIT_ARGS = Signature("ptr wb", "f32 a_unscale")  # (project_wgmma_split.cu)
GATED_OUT_PROJECT_PERSISTENT = Signature("ptr qkvg", "i64 M", "ptr wo_image", "ptr b_out",
                                         "ptr out", "f32 w_unscale")
ATTENTION = Signature("ptr qkvg", "ptr bias", "i32 B", "i32 N", "i32 H", "i32 npk",
                      "i32 nan_fully_masked")
MASK_KEY_EXTENT = _MASK + Signature("i32 N", "i32 chunks", "ptr key_extent")
ROW_MASK_PACK = _MASK + Signature("i32 B", "i32 N", "i32 words_per_row", "ptr row_mask")
# layernorm_bias_ffma.cu (the persistent projections' bias pass of row blocks)
LAYERNORM_BIAS = Signature(
    "ptr x", "i64 sb", "i64 si", "i64 sj", "i32 N", "f32 eps",
    "ptr w_ln", "ptr c_ln") + _MASK + Signature("ptr bias", "i32 npk")
# What ROW_BLOCK adds last (kernels/common.cuh): the rows (b, i) a launch takes
ROW_BLOCK_ARGS = Signature("i64 row_begin", "i64 row_end")
# layernorm_bias_ffma.cu: pair rows a block takes per step (8 warps of 4 rows: ROW_LANES 8)
# and resident blocks per SM (BIAS_MIN_BLOCKS); it loops over its rows, so a grid of that
# many blocks per SM covers any number of them.
LAYERNORM_BIAS_ROWS = 32
LAYERNORM_BIAS_BLOCKS_PER_SM = 2


class PlanKey(typing.NamedTuple):
    """The key of DeviceWeights.plans: what a Plan depends on, as the arrays give it (byte
    strides; the mask's dtype and byte strides), cheap to build and hash at every call (a
    named tuple: a dataclass's construction costs a call's host time at small sizes).
    out_transposed: the ending node (Conventions.transposed); row_mask: a mask in the row
    layout (Conventions.row_mask)."""
    shape: tuple
    strides: tuple
    aligned: bool
    mask: tuple | None
    precision: str
    nan_fully_masked: bool
    route: typing.Any = None
    out_transposed: bool = False
    row_mask: bool = False
    pair_dtype: str = "float32"

    @classmethod
    def of(cls, pair, mask, precision: str, nan_fully_masked: bool, route=None, *,
           out_transposed: bool = False, row_mask: bool = False,
           pair_dtype: str = "float32") -> "PlanKey":
        return cls(pair.shape, pair.strides, pair.data.ptr % 16 == 0,
                   None if mask is None else (mask.dtype, mask.strides), precision,
                   nan_fully_masked, route, out_transposed, row_mask, pair_dtype)


class Plan:
    """The launches of a forward pass over one input geometry (a PlanKey), built from its
    Route (routes.choose_route decides; nothing is decided here). Made once per module and
    geometry (Forward keeps them in DeviceWeights.plans): at small sizes the host time
    before the first kernel starts is what the caller waits for. Stages, in order:
    `project`, `attention`, `out_project`, each a Launch taking the pointers pair, mask,
    qkvg, bias, vt, extent and out; `key_extent` and `row_mask` (row_mask_pack) before the
    attention where the forward needs them; `launches` builds them (and row blocks')."""

    def __init__(self, dw: DeviceWeights, key: PlanKey,
                 attention: "kernel_configs.AttentionLaunch | None" = None):
        self._geometry(dw, key)
        self.route = _route(dw, key, self, attention)
        self.attention_kernel = attention or self.route.attention_launch(self.d, self.N)
        self.layout = self.route.layout
        self.project_mma = self.route.project != "ffma"
        self.project_split = self.route.products == "f16x3"
        self.project_f16 = self.route.products in ("f16", "f16x3")  # fp16 products (F16_TERMS)
        self.project_persistent = self.route.project == "persistent"
        self.out_persistent = self.route.out_project == "persistent"
        self.scales = dw.qkv_scales.get(self.route.scales)
        self._scratch()
        self.nan_fully_masked = key.nan_fully_masked
        self.out_transposed = key.out_transposed
        mask_meta = _mask_meta(key.mask)
        if key.row_mask and mask_meta is None:
            raise ValueError("row_mask needs a mask")
        # The row mask layout: the projection folds no mask into the bias (its mask is
        # indexed by the row i, which the bias shared by every row cannot hold);
        # row_mask_pack packs it into key bits per row (b, i), which the attention applies
        # (ROW_MASK). The key extent reads the mask as is: the same reduction over its
        # middle axis.
        self.projection_mask = None if key.row_mask else mask_meta
        # Rows per out-projection block (its tiles: a row block must start one, row_blocks)
        self.out_rows = (tiles.PERSISTENT_ROWS if self.out_persistent else
                         tiles.out_project_rows(self.M, dw.sm_count,
                                                self.route.out_project == "mma"))
        self.launches = build = RouteLaunches(dw, self)
        self.row_block_launches = None  # (row_blocks.RowBlockLaunches.of: made on first use)
        self.key_extent = build.key_extent(mask_meta) if self.route.key_extent else None
        self.row_mask = build.row_mask_pack(mask_meta) if key.row_mask else None
        self._extras()
        self.project = build.project()
        self.attention = build.attention(self.attention_kernel)
        self.out_project = build.out_project()

    def _geometry(self, dw: DeviceWeights, key: PlanKey):
        """B, N, D, H, d, M; the pair's strides in elements and whether its rows take
        vector loads (x_vec)."""
        B, N, _ = pair_geometry(key.shape, dw.pair_dim)
        self.B, self.N, self.D, self.H, self.d = B, N, dw.pair_dim, dw.num_heads, dw.head_dim
        self.M = B * N * N
        # The pair's elements: float32, or 16 bits (PAIR_DTYPE: read as that, the output
        # written as that)
        self.pair_dtype = key.pair_dtype
        itemsize = 4 if key.pair_dtype == "float32" else 2
        strides = tuple(s // itemsize for s in key.strides)
        sb, si, sj, sc = strides if len(strides) == 4 else (0, *strides)
        self.strides = (sb, si, sj, sc)
        # The pair's rows contiguous and 16-byte aligned: vector loads (x_vec), and the
        # persistent LayerNorm projection, which copies whole rows
        self.x_vec = int(sc == 1 and all(s % (16 // itemsize) == 0 for s in (sb, si, sj))
                         and key.aligned)

    def _scratch(self):
        """The scratch arrays in one pool allocation: qkvg, the bias after it (M * 8D bytes
        at least: a multiple of 32, so the bias starts 16-byte aligned for its tile copies),
        the K and V^T tiles after the bias."""
        B, N, H, layout = self.B, self.N, self.H, self.layout
        # The key axis of the bias is padded with -inf to whole key tiles of either
        # attention kernel (at most BIAS_KEY_ALIGN keys; the tensor-core kernel copies
        # whole tiles).
        self.npk = -(-N // tiles.BIAS_KEY_ALIGN) * tiles.BIAS_KEY_ALIGN
        # qkvg rows of 4D, 2D or D words (layouts.Layout.row_words; project_epilogue.cuh
        # QKVG_LD)
        row_words = layout.row_words * self.D
        self.qkvg_shape, self.bias_shape = (self.M, row_words), (B, H, N, self.npk)
        self.qkvg_bytes = self.M * row_words * 4
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
        # The K and V^T tiles per (b, i, head, 64 keys) (a multiple of 256 bytes from the
        # start: 16-byte aligned for the tile copies)
        self.vt_bytes = B * N * H * (self.npk // tiles.WGMMA_KEYS) * layout.tile_bytes
        self.scratch_bytes = self.qkvg_bytes + self.bias_bytes + self.vt_bytes

    def _extras(self):
        """After the rest of the scratch: each batch's key extent under the mask (B ints),
        where the attention's key loops may stop early; the row mask's key bits
        (B N npk / 32 words). Their offsets are 0 where the plan has none."""
        self.extent_offset = self.row_mask_offset = 0
        if self.key_extent is not None:
            self.extent_offset = self.scratch_bytes
            self.scratch_bytes += 4 * self.B
        if self.row_mask is not None:
            self.row_mask_offset = self.scratch_bytes
            self.scratch_bytes += 4 * self.B * self.N * (self.npk // 32)

    def attention_launch(self, kernel: "kernel_configs.AttentionLaunch", nan_fully_masked: bool):
        """The attention stage with `kernel` in place of the plan's (tile sweeps)."""
        return self.launches.attention(kernel, nan_fully_masked=nan_fully_masked)

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


def _route(dw: DeviceWeights, key: PlanKey, plan: Plan,
           attention: "kernel_configs.AttentionLaunch | None") -> "routes.Route":
    """The route of `key`'s forward: the one `attention` kernel forced (tile sweeps and
    tests) or key.route's, else the fastest (routes.choose_route)."""
    geometry = dict(rows_aligned=bool(plan.x_vec), smem_limit=dw.smem_limit,
                    masked=key.mask is not None)
    if attention is not None:
        if key.route is not None:
            raise ValueError("give route= or attention=, not both")
        route = routes.route_for_attention(attention, key.precision, plan.D, plan.N,
                                           dw.compute_capability, **geometry)
    else:
        route = routes.choose_route(key.precision, plan.d, plan.D, plan.N,
                                    dw.compute_capability,
                                    f16s_scales=dw.qkv_scales["f16s"] is not None,
                                    force=key.route, **geometry)
    # (a forced attention kernel too: the f16s one reads scales these weights may not have)
    if route.scales == "f16s" and dw.qkv_scales["f16s"] is None:
        raise ValueError(f"route {route.name!r} needs these weights' scores inside fp16's "
                         f"range (scales.f16s_scales: their bound passes 2^15 in log2 "
                         f"units); use another route")
    return route


class RouteLaunches:
    """The launches of a plan's route: configuration, grid, block, shared memory and
    arguments by name, built here alone. `row_block=True` gives row blocks' form
    (gpu/row_blocks.py): the configuration with ROW_BLOCK, the rows [row_begin, row_end)
    last and the grid given by each call; its projection takes the split bias weights as
    "wb" and its out projection M as "M" from the call."""

    def __init__(self, dw: DeviceWeights, plan: Plan):
        self.dw, self.plan = dw, plan

    def key_extent(self, mask_meta) -> Launch:
        """mask_key_extent: each batch's last kept key (key_extent.cu)."""
        p = self.plan
        chunks = tiles.key_extent_chunks(p.N)
        return Launch(kernel_configs.key_extent_config(), "mask_key_extent", chunks * p.B,
                      tiles.KEY_EXTENT_THREADS, 0,
                      MASK_KEY_EXTENT.bind(**_mask_args(mask_meta), N=p.N, chunks=chunks,
                                           key_extent=Call("extent")))

    def row_mask_pack(self, mask_meta) -> Launch:
        """row_mask_pack: the row mask's key bits per row (b, i) (row_mask.cu)."""
        p = self.plan
        words = p.npk // 32
        count = p.B * p.N * words
        return Launch(kernel_configs.row_mask_config(), "row_mask_pack",
                      -(-count // kernel_configs.ROW_MASK_THREADS), kernel_configs.ROW_MASK_THREADS, 0,
                      ROW_MASK_PACK.bind(**_mask_args(mask_meta), B=p.B, N=p.N,
                                         words_per_row=words, row_mask=Call("row_mask")))

    def project(self, row_block: bool = False, bias_only: bool = False) -> Launch:
        """ln_qkvg_project: LayerNorm, q, k, v, the gate and the pair bias; `bias_only`
        (project_mma.cu, project_ffma.cu, row blocks' bias pass): LayerNorm and the bias."""
        if self.plan.project_persistent:
            return self._persistent_projection(row_block)
        p, dw, r = self.plan, self.dw, self.plan.route
        rows = tiles.project_rows(p.D, p.M, dw.sm_count, dw.smem_limit, p.project_mma)
        config = kernel_configs.project_config(rows, r.project, p.D, p.layout, r.products,
                                       p.pair_dtype)
        signature = LN_QKVG_PROJECT + (F16_TERMS_ARGS if p.project_f16 else Signature())
        sb, si, sj, sc = p.strides
        values = dict(
            x=Call("pair"), sb=sb, si=si, sj=sj, sc=sc, x_vec=p.x_vec, B=p.B, N=p.N, D=p.D,
            H=p.H, eps=dw.eps, q_scale=LOG2E / math.sqrt(p.d), gamma=dw.gamma.data.ptr,
            beta=dw.beta.data.ptr,
            W=dw.projection_weight("qkvg", p.weight_layout, p.scales).data.ptr,
            b_qkvg=dw.qkvg_bias(p.scales).data.ptr,
            Wb=dw.bias_weight(p.project_f16, p.scales).data.ptr,
            **_mask_args(p.projection_mask), qkvg=Call("qkvg"), bias=Call("bias"),
            npk=p.npk, vt=Call("vt"), **self._f16_projection_args())
        if row_block:
            config = kernel_configs.row_blocked(config)
            if bias_only:
                config = kernel_configs.bias_only(config)
        return self._launch(config, f"ln_qkvg_project_{r.project}_{r.products}",
                            -(-p.M // rows), tiles.PROJECT_THREADS,
                            tiles.project_smem_bytes(p.D, rows, p.project_mma),
                            signature, values, row_block)

    def _persistent_projection(self, row_block: bool) -> Launch:
        """ln_qkvg_project_wgmma: one block per SM over the tiles of 64 keys (b, i, 64c ..),
        its weights resident (DeviceWeights.tile_weight_image); the split kernel (fp32
        mode) also takes the pair-bias weights in fp32 and 1 / a_scale."""
        p, dw = self.plan, self.dw
        s = dw.f16_scales(p.scales)
        split = tiles.persistent_split(p.layout)
        n_tiles = p.B * p.N * -(-p.N // tiles.PERSISTENT_ROWS)
        signature = LN_QKVG_PROJECT_PERSISTENT + (PERSISTENT_SPLIT_ARGS if split
                                                  else Signature())
        sb, si, sj, _ = p.strides
        values = dict(
            x=Call("pair"), sb=sb, si=si, sj=sj, B=p.B, N=p.N, H=p.H, eps=dw.eps,
            gamma_beta=dw.tile_gamma_beta(s.a).data.ptr,
            w_image=dw.tile_weight_image("qkvg", p.scales, split).data.ptr,
            col_bias=dw.qkvg_bias(p.scales).data.ptr,
            q_scale=LOG2E / math.sqrt(p.d), unscale=1.0 / (s.a * s.w),
            **_mask_args(p.projection_mask), qkvg=Call("qkvg"), bias=Call("bias"),
            npk=p.npk, vt=Call("vt"))
        if split:  # (row blocks' projections write no bias: the call's null "wb")
            values.update(wb=Call("wb") if row_block else
                          dw.bias_weight(False, p.scales).data.ptr, a_unscale=1.0 / s.a)
        config = kernel_configs.persistent_project_config(p.layout, p.pair_dtype)
        if row_block:
            config = kernel_configs.row_blocked(config)
        return self._launch(config, "ln_qkvg_project_wgmma_" + ("f16x3" if split else "f16"),
                            min(n_tiles, dw.sm_count), tiles.PERSISTENT_THREADS,
                            tiles.persistent_smem_bytes(p.layout), signature, values,
                            row_block)

    def attention(self, kernel: "kernel_configs.AttentionLaunch", row_block: bool = False,
                  nan_fully_masked: bool | None = None) -> Launch:
        """The attention `kernel` on the plan's scratch (it must read the layout and the
        scales the plan's projection writes)."""
        p = self.plan
        if kernel.layout != p.layout:
            raise ValueError(f"launch {kernel.name} reads the layout {kernel.layout.name}, "
                             f"but this forward's projection writes {p.layout.name}; build "
                             f"the Forward with attention=that launch")
        if (kernel.name == "attention_wgmma_f16s") != (p.route.scales == "f16s"):
            raise ValueError(f"launch {kernel.name} reads q, k and the bias scaled otherwise "
                             f"than this forward's projection scales them "
                             f"({p.route.scales!r}); build the Forward with attention=that "
                             f"launch")
        nan = p.nan_fully_masked if nan_fully_masked is None else nan_fully_masked
        signature, values = ATTENTION, dict(qkvg=Call("qkvg"), bias=Call("bias"), B=p.B,
                                            N=p.N, H=p.H, npk=p.npk,
                                            nan_fully_masked=int(nan))
        if kernel.layout.tiled:  # and v (and k) from the tiles
            signature += Signature("ptr vt")
            values["vt"] = Call("vt")
        if kernel.layout.scaled:  # undo the projection's scales
            s_q, s_k, s_v, _ = p.scales
            signature += Signature("f32 qk_unscale", "f32 v_unscale")
            values.update(qk_unscale=1.0 / (s_q * s_k), v_unscale=1.0 / s_v)
        if kernel.operand_scales:  # the kernel scales fp32 q, k, v into fp16's range itself
            signature += Signature("f32 s_q", "f32 s_k", "f32 s_v")
            values.update(zip(("s_q", "s_k", "s_v"), self.dw.f16x3_scales))
        signature += Signature("ptr key_extent")  # (null: all N keys)
        values["key_extent"] = Call("extent")
        config, smem = kernel.config, kernel.smem
        if p.row_mask is not None:  # (ROW_MASK: the key bits last)
            config = kernel_configs.row_masked(config)
            signature += Signature("ptr row_mask")
            values["row_mask"] = Call("row_mask")
            smem += kernel_configs.row_mask_smem_bytes(kernel, p.npk)
        if row_block:
            config = kernel_configs.row_blocked(config)
        return self._launch(config, kernel.name, kernel.blocks(p.B, p.N, p.H),
                            kernel.threads, smem, signature, values, row_block,
                            dependent=True)

    def out_project(self, row_block: bool = False) -> Launch:
        """gated_out_project: out = (g o) Wo^T + b_out, each row to the caller's layout
        under OUT_TRANSPOSED (the ending node; its kernels take N last)."""
        p, dw, r = self.plan, self.dw, self.plan.route
        if p.out_persistent:  # one block per SM over the tiles of 64 rows, Wo resident
            split = tiles.persistent_split(p.layout)
            config = kernel_configs.persistent_project_config(p.layout, p.pair_dtype)
            name = "gated_out_project_wgmma_" + ("f16x3" if split else "f16")
            grid = min(-(-p.M // tiles.PERSISTENT_ROWS), dw.sm_count)
            threads = tiles.PERSISTENT_THREADS
            smem = tiles.persistent_smem_bytes(p.layout, out=True)
            signature = GATED_OUT_PROJECT_PERSISTENT
            values = dict(wo_image=dw.tile_weight_image("out", split=split).data.ptr)
        else:
            config = kernel_configs.project_config(p.out_rows, r.out_project, p.D, p.layout,
                                           r.products, p.pair_dtype)
            name = f"gated_out_project_{r.out_project}_{r.products}"
            grid, threads = -(-p.M // p.out_rows), tiles.PROJECT_THREADS
            smem = tiles.project_smem_bytes(p.D, p.out_rows, p.project_mma)
            signature = GATED_OUT_PROJECT + (Signature("f32 w_unscale") if p.project_f16
                                             else Signature())
            values = dict(D=p.D, W=dw.projection_weight("out", p.weight_layout,
                                                        p.scales).data.ptr)
        values.update(qkvg=Call("qkvg"), M=Call("M") if row_block else p.M,
                      b_out=dw.b_out.data.ptr, out=Call("out"),
                      **self._f16_projection_args(out=True))
        if p.out_transposed:
            config = kernel_configs.out_transposed(config)
            signature += Signature("i32 N")
            values["N"] = p.N
        # (row blocks: the out projection's configuration is the single pass's, its M per
        # segment from the call)
        return Launch(config, name, None if row_block else grid, threads, smem,
                      signature.bind(**values), dependent=not row_block)

    def bias_pass(self) -> tuple[Launch, int, int | None]:
        """(launch, rows per block, most blocks) of row blocks' bias pass: the plan's own
        project_mma.cu or project_ffma.cu projection under BIAS_ONLY (the single pass's
        LayerNorm and bias code: the same bits), or for the persistent projections (whose
        bias comes out of the products of q and the gate) layernorm_bias_ffma.cu, a
        streaming kernel of a few resident blocks per SM, writing the same bias form."""
        p, dw = self.plan, self.dw
        if not p.project_persistent:
            launch = self.project(row_block=True, bias_only=True)
            return launch, dict(launch.config.defines)["BM"], None
        config = kernel_configs.layernorm_bias_config(kernel_configs.bias_pass_layout(p.layout), p.D, p.H,
                                              p.pair_dtype)
        w_ln, c_ln = dw.layernorm_bias_weight(p.scales)
        sb, si, sj, _ = p.strides  # (rows contiguous: routes.choose_route)
        launch = self._launch(
            config, "layernorm_bias_ffma", 1, kernel_configs.LAYERNORM_BIAS_THREADS,
            kernel_configs.layernorm_bias_smem_bytes(p.D, p.pair_dtype), LAYERNORM_BIAS,
            dict(x=Call("pair"), sb=sb, si=si, sj=sj, N=p.N, eps=dw.eps, w_ln=w_ln.data.ptr,
                 c_ln=c_ln.data.ptr, **_mask_args(p.projection_mask), bias=Call("bias"),
                 npk=p.npk), row_block=True)
        return launch, LAYERNORM_BIAS_ROWS, LAYERNORM_BIAS_BLOCKS_PER_SM * dw.sm_count

    @staticmethod
    def _launch(config, name, grid, threads, smem, signature, values, row_block: bool,
                dependent: bool = False) -> Launch:
        """A Launch; in row blocks' form the rows [row_begin, row_end) last and the grid
        each call gives."""
        if row_block:
            signature += ROW_BLOCK_ARGS
            values = dict(values, row_begin=Call("row_begin"), row_end=Call("row_end"))
            grid, dependent = None, False
        return Launch(config, name, grid, threads, smem, signature.bind(**values),
                      dependent=dependent)

    def _f16_projection_args(self, out: bool = False) -> dict:
        """The fp16 products' last arguments of ln_qkvg_project, a_scale and unscale (or
        `out`: gated_out_project's w_unscale); none otherwise."""
        p = self.plan
        if not p.project_f16:
            return {}
        s = self.dw.f16_scales(p.scales)
        if out:  # the kernel scales each block's g o itself (load_gated_tile_f16); o comes
            # in v's units where the attention writes it in fp16 (O16)
            o_unit = p.scales[2] if p.layout.o16 == "fp16" else 1.0
            return {"w_unscale": 1.0 / (s.out_w * o_unit)}
        return {"a_scale": s.a, "unscale": 1.0 / (s.a * s.w)}


def make_plan(dw: "DeviceWeights", key: PlanKey,
              attention: "kernel_configs.AttentionLaunch | None" = None) -> Plan:
    """The Plan of `key` (with `attention` forced: tile sweeps and tests)."""
    return Plan(dw, key, attention)


def _mask_meta(mask_key):
    """What of the mask a plan depends on, from PlanKey.mask (dtype, byte strides): None, or
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
