"""`deltaflash bench <what>`: measured side by side, printed as a table, written as JSON."""

from __future__ import annotations


def register(sub) -> None:
    from deltaflash.bench import attention, e2e, kernels, model, round, serve

    bench = sub.add_parser("bench", help="benchmarks (GPU for meaningful numbers)")
    what = bench.add_subparsers(dest="bench", required=True)
    for module in (model, kernels, attention, round, serve, e2e):
        module.register(what)
    bench.set_defaults(func=lambda args: 0)
