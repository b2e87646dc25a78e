"""Time the wgmma attention built with extra compile-time switches against the tree's own build, on the GPU.

    python tools/ab_attention.py --variant g2:PV_GROUPS=2 --precisions fp32 1x1024x128x4
    python tools/ab_attention.py --variant s3:STAGES=3,MIN_BLOCKS=2 --precisions bf16 \\
        --rounds 6 1x1024x128x4

A variant NAME:SWITCH=VALUE[,SWITCH=VALUE...] adds those #defines to every configuration
of kernels/attention_wgmma.cu (a SWITCH the file does not define is refused: the
preprocessor would ignore it and the A/B would time the tree twice). For each round, size,
precision and variant (the tree's build is "base"): a fresh forward on tools/time_forward.py's
padded inputs, the attention timed as the difference of the medians of (projection +
attention) and (projection), the forward as the median of all its stages. The method
behind it (docs/performance.md, Method): the module's launch plans are cleared before
every variant (a plan holds its kernels, so without that every variant would run the
first one's); the order of the variants is reversed every other round (a fixed order
biases them by their place); every variant is compiled first, in parallel. The medians
over rounds are printed against base's, each round's attention after them. Then each
variant's output is compared bit for bit with base's, in a single pass and in row blocks,
at 1x333x128x4 and 2x97x128x4 (sizes that miss every tile).
"""
import argparse
import dataclasses
import pathlib
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
KERNEL = HERE.parent / "kernels" / "attention_wgmma.cu"
PRECISIONS = ("bf16", "tf32", "fp32")
BIT_SIZES = ("1x333x128x4", "2x97x128x4")


def parse_variant(text: str, known: set) -> tuple:
    """(name, ((SWITCH, value), ...)) from "NAME:SWITCH=VALUE[,SWITCH=VALUE...]"."""
    name, sep, rest = text.partition(":")
    if not sep or not name or name == "base" or not rest:
        raise ValueError(f"--variant must be NAME:SWITCH=VALUE[,...] with NAME not 'base'; "
                         f"got {text!r}")
    defines = []
    for item in rest.split(","):
        switch, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"-?\d+", value):
            raise ValueError(f"--variant {name}: each switch must be SWITCH=INTEGER; got {item!r}")
        if switch not in known:
            raise ValueError(f"--variant {name}: {KERNEL.name} has no switch {switch!r} "
                             f"(#ifndef {switch})")
        defines.append((switch, int(value)))
    return name, tuple(defines)


def kernel_switches() -> set:
    """The names kernels/attention_wgmma.cu lets a configuration define (#ifndef NAME)."""
    return set(re.findall(r"^#ifndef (\w+)", KERNEL.read_text(), flags=re.M))


class Variants:
    """The variants by name, and which one routes.attention_wgmma_launch builds now."""

    def __init__(self, variants: dict):
        from triattn_cupy.gpu import routes

        self.defines = {"base": (), **variants}
        self.current = "base"
        self._routes, self._launch = routes, routes.attention_wgmma_launch
        routes.attention_wgmma_launch = self._patched

    def restore(self):
        """routes.attention_wgmma_launch as it was."""
        self._routes.attention_wgmma_launch = self._launch

    def _patched(self, *args, **kwargs):
        launch = self._launch(*args, **kwargs)
        extra = self.defines[self.current]
        return dataclasses.replace(launch, config=launch.config.with_defines(*extra)) if extra else launch

    def attention_config(self, name: str, precision: str, size: str, row_block: bool):
        """The attention configuration variant `name` builds for a padded forward."""
        from triattn_cupy.gpu import kernel_configs

        self.current = name
        B, N, D, h = map(int, size.split("x"))
        route = self._routes.choose_route(precision, D // h, D, N, 90, masked=True)
        config = route.attention_launch(D // h, N).config
        return kernel_configs.row_blocked(config) if row_block else config


_VARIANTS = None


def _compile(job):
    from triattn_cupy.gpu import compile as kernel_compile

    name, precision, size, row_block = job
    config = _VARIANTS.attention_config(name, precision, size, row_block)
    if config.filename == KERNEL.name:
        kernel_compile._cubin_file(config.filename, config.defines, config.arch)


def _init_worker(variants):
    global _VARIANTS
    _VARIANTS = Variants(variants)


def time_variants(variants: Variants, sizes, precisions, rounds):
    from time_forward import median_ms, padded_inputs

    names = list(variants.defines)
    inputs = {size: padded_inputs(size) for size in sizes}
    times = {}
    for r in range(rounds):
        for size in sizes:
            module, pair, mask = inputs[size]
            repeats = 30 if int(size.split("x")[1]) <= 512 else 10
            for precision in precisions:
                for name in (names if r % 2 == 0 else names[::-1]):
                    variants.current = name
                    module._dw.plans.clear()  # the plan holds the kernels it was built with
                    stages = module.stage_launchers(pair, mask, precision=precision)
                    at = [stage for stage, _ in stages].index("attention")
                    before = lambda: [launch() for _, launch in stages[:at]]  # noqa: E731
                    upto = lambda: [launch() for _, launch in stages[:at + 1]]  # noqa: E731
                    whole = lambda: [launch() for _, launch in stages]  # noqa: E731
                    whole(), whole()
                    t_before, t_upto = median_ms(before, repeats), median_ms(upto, repeats)
                    times.setdefault((size, precision, name), []).append(
                        (t_upto - t_before, median_ms(whole, repeats)))
        print(f"round {r + 1} of {rounds}", file=sys.stderr, flush=True)
    for size in sizes:
        for precision in precisions:
            base = [statistics.median(x) for x in zip(*times[(size, precision, "base")])]
            for name in names:
                runs = times[(size, precision, name)]
                attention, forward = (statistics.median(x) for x in zip(*runs))
                print(f"{size:13s} {precision:5s} {name:8s} attention {attention:.4f} ms "
                      f"({100 * (attention / base[0] - 1):+.1f}%)  forward {forward:.4f} ms "
                      f"({100 * (forward / base[1] - 1):+.1f}%)  rounds "
                      + " ".join(f"{a:.4f}" for a, _ in runs), flush=True)


def compare_bits(variants: Variants, precisions):
    import cupy
    import numpy as np
    from time_forward import padded_inputs

    for size in BIT_SIZES:
        module, pair, mask = padded_inputs(size)
        N = int(size.split("x")[1])
        for precision in precisions:
            outputs = {}
            for name in variants.defines:
                variants.current = name
                module._dw.plans.clear()
                single = cupy.asnumpy(module(pair, mask, precision=precision))
                module._dw.plans.clear()
                blocked = cupy.asnumpy(module(pair, mask, precision=precision,
                                              row_block=N // 3 + 1))
                outputs[name] = single, blocked
            base = outputs["base"]
            verdicts = ", ".join(
                f"{name} " + "/".join("same" if np.array_equal(o, b) else "DIFFERENT"
                                      for o, b in zip(out, base))
                + (" (NaN)" if np.isnan(out[0]).any() else "")
                for name, out in outputs.items() if name != "base")
            print(f"{size} {precision}: bits against base (single pass / row blocks): {verdicts}",
                  flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="+", help="BxNxDxh")
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME:SWITCH=VALUE[,SWITCH=VALUE...] (repeatable)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    known = kernel_switches()
    try:
        variants = dict(parse_variant(text, known) for text in args.variant)
    except ValueError as error:
        ap.error(str(error))
    precisions = args.precisions.split(",")
    jobs = [(name, precision, args.sizes[0], row_block) for name in ("base", *variants)
            for precision in precisions for row_block in (False, True)]
    with ProcessPoolExecutor(initializer=_init_worker, initargs=(variants,)) as pool:
        list(pool.map(_compile, jobs))
    import cupy

    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    chosen = Variants(variants)
    time_variants(chosen, args.sizes, precisions, args.rounds)
    compare_bits(chosen, precisions)


if __name__ == "__main__":
    main()
