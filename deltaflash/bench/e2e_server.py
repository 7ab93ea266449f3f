"""`deltaflash bench e2e --server URL`: the same concurrency sweep against a running `deltaflash serve`
over HTTP (streaming /v1/completions, greedy, held-out demo prompts sent as token ids tokenized with
--model's tokenizer, default the bundled target's). Mean accepted length and the prefill / decode
split come from the server's /metrics before and after each point. `--target-only-server URL` (a
second server on the same target without a drafter) is measured in the same run as mode
"target-only"; without it only mode "spec" is measured."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from deltaflash.bench.common import machine, write_json
from deltaflash.bench.e2e_stats import compare, latency_summary, report
from deltaflash.bench.serve import Trace, _stream, device_idle, scrape
from deltaflash.bundled import BUNDLED


def run_server(args) -> int:
    from tqdm import tqdm

    from deltaflash.bench.e2e_plots import plot
    from deltaflash.tokenizer import encode_prompt, load_tokenizer
    from deltaflash.train.corpus import heldout_prompts, load_split

    if args.workload != "demo":
        raise SystemExit("--server runs the demo workload (a scripted drafter cannot be attached to a server)")
    tok = load_tokenizer(Path(args.model or BUNDLED / "target"))
    prompts = [encode_prompt(tok, t) for t in heldout_prompts(load_split(), args.prompts, num_lines=args.prompt_lines)]
    servers = {"spec": args.server} | ({"target-only": args.target_only_server} if args.target_only_server else {})
    points, outputs = [], {}
    with tqdm(total=len(args.concurrency) * len(servers), unit="point", disable=args.quiet) as bar:
        for c in args.concurrency:
            for mode, url in servers.items():
                bar.set_description(f"server C={c} {mode}")
                point, tokens = asyncio.run(_point(args, url, prompts, c))
                points.append({"workload": "demo", "concurrency": c, "mode": mode} | point)
                outputs[(c, mode)] = tokens
                bar.update()
            if "target-only" in servers:
                compare(points[-2:], outputs[(c, "spec")], outputs[(c, "target-only")])
    result = {"workload": "demo", "label": f"demo prompts over HTTP ({', '.join(f'{m}: {u}' for m, u in servers.items())})",
              "block_size": args.block_size or 8,  # for the plot's axis only (8: the bundled drafter's W)
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "meta": {"servers": servers},
              "points": points, "figures": {}, "machine": machine()}
    report(result)
    out = Path(args.out)
    write_json(out / "e2e-demo-server.json", result)
    result["workload"] = "demo-server"
    for path in plot(result, out):
        print(f"wrote {path}")
    return 0 if all(p.get("mismatched_sequences", 0) == 0 for p in points) else 1


async def _point(args, url: str, prompts: list[list[int]], concurrency: int) -> tuple[dict, list[list[int]]]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as http:
        card = (await http.get("/v1/models")).raise_for_status().json()["data"][0]
        body = {"model": card["id"], "max_tokens": args.max_new_tokens, "temperature": 0, "return_token_ids": True,
                "stream": True}
        requests = max(len(prompts), concurrency)
        traces = [Trace(i % len(prompts), None) for i in range(requests)]
        starts = [0.0] * requests
        pending = iter(range(requests))
        before = scrape((await http.get("/metrics")).text)

        async def client():
            for i in pending:
                starts[i] = time.perf_counter() - t0
                await _stream(http, body | {"prompt": prompts[traces[i].prompt_index]}, traces[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = scrape((await http.get("/metrics")).text)
    errors = [t.error for t in traces if t.error]
    if errors:
        raise SystemExit(f"{url}: {len(errors)} requests failed, first: {errors[0]}")
    tokens = sum(len(t.token_ids) for t in traces)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    rounds = delta.get("accepted_count", 0.0)
    phase = {k: delta.get(f"phase_{k}", 0.0) for k in ("prefill", "decode")}
    point = {"requests": requests, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
    # _stream's chunk times are from each request's send
    point |= latency_summary([(t.chunk_times[0], t.chunk_times[-1], list(zip(t.chunk_times, t.chunk_tokens)),
                               len(t.token_ids)) for t in traces if t.chunk_times])
    point |= {"mean_accepted_length": delta["accepted_sum"] / rounds if rounds else None, "rounds": int(rounds),
              "accepted_lengths": [], "server_phase_seconds": phase} | device_idle(before, after, wall)
    return point, [t.token_ids for t in traces]

