"""`vime`: the command line over the same flows the Prefect deployments run.

    vime train   [--config FILE] [--<field> VALUE ...]     the train flow (bootstrap + iterations)
    vime replay  --source-run RUN --checkpoint PATH (--rollout-ids K ... | --weight-version V) [--rewards WHICH]
    vime rescore --run RUN --custom-rm-path MOD:FN [--rollout-ids K ...] [--json]   score stored samples again
    vime lineage [--storage-uri URI] [--run RUN] (--weight-version V | --prompts-seen-twice | --reward-by-iteration |
    --batches | --quarantined)
    vime lineage --run RUN --ledger                          the compute ledger per rollout id (docs/running.md)
    vime lineage --run RUN --turns K [--sample ROW ...]      a stored sample's turns (model / tool spans)
    vime cluster up [--num-gpus N] [--temp-dir DIR] | down | status   a local Ray head on loopback
    vime teardown --run-name RUN                          stop a run's engines and actors
    vime prune   [--run RUN] [--older-than-days D] [--yes]

`--help` answers without importing Prefect, Ray or torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flows.console import one_line_failures
from flows.settings import apply_env_defaults
from vime_core.cluster import local_head
from vime_core.cluster.connect import LOOPBACK_ENV
from vime_core.data.turns import sample_turns
from vime_core.utils import interrupt

# The configuration, Prefect, Ray, storage and torch are imported inside the command that needs them:
# `vime --help` and `vime cluster` start without them.


def _config_parser(prog: str):
    from vime_core.config.loader import build_parser

    return build_parser(prog)


def _config_from(ns: dict, parser):
    from vime_core.config.loader import config_from_namespace

    return config_from_namespace(ns, parser)


def cmd_train(argv: list[str]) -> int:
    parser = _config_parser("vime train")
    cfg = _config_from(vars(parser.parse_args(argv)), parser)
    interrupt.install(
        f"\n[vime] interrupted: stored batches and the last checkpoint are kept; "
        f"run again with --run-name {cfg.run_name} to resume\n"
    )
    if cfg.early_start:  # the run's actors start while the flow is imported and starts Prefect's server
        from vime_core.cluster.early_start import start_actors_early

        start_actors_early(cfg)
    from flows.train import RunStoppedError, train  # Prefect: seconds of imports, beside the engines' start

    try:
        with one_line_failures():  # the flow run's own failure line, without a page of traceback
            summary = train(cfg)
    except KeyboardInterrupt:
        # the caller's cleanup (infra/main_job.sh) stops engines, actors and the Ray head
        os._exit(interrupt.exit_status())
    except RunStoppedError as exc:
        if interrupt.received() is not None:  # the signal's failure, not the run's
            os._exit(interrupt.exit_status())
        # the flow already logged why; the user's last line says it once more, without a traceback
        sys.stderr.write(f"[vime] run {cfg.run_name!r} stopped: {exc}\n")
        return 1
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_replay(argv: list[str]) -> int:
    parser = _config_parser("vime replay")
    parser.add_argument("--source-run", required=True, help="Run whose stored batches are replayed.")
    parser.add_argument("--checkpoint", required=True, help="Trainer checkpoint to start from.")
    parser.add_argument("--rollout-ids", type=int, nargs="+", help="Rollout ids of the batches.")
    parser.add_argument("--weight-version", type=int, help="Replay every batch sampled from this weight version.")
    parser.add_argument(
        "--rewards",
        default="stored",
        metavar="stored|rescored|vN",
        help="Rewards to train on: stored (the batches' own), rescored (each batch's newest `vime rescore` "
        "version, else its own) or vN (that re-scoring; every batch must be in it).",
    )
    ns = vars(parser.parse_args(argv))
    extra = {k: ns.pop(k, None) for k in ("source_run", "checkpoint", "rollout_ids", "weight_version", "rewards")}
    cfg = _config_from(ns, parser)
    from flows.replay import replay

    out = replay(cfg, **extra)
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_rescore(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="vime rescore",
        description="Score a run's stored samples again with a new reward function (no generation), store the new "
        "rewards beside the old ones (rescored/<run>/v<N>) and print what the old ones reached: per rollout, the "
        "samples whose reward changed, the advantages that moved, the checkpoints trained on them.",
    )
    _add_storage_arguments(parser)
    parser.add_argument(
        "--custom-rm-path", required=True, help="The new reward function, module:function or file:function."
    )
    parser.add_argument("--rollout-ids", type=int, nargs="+", help="Only these stored batches (default: all).")
    parser.add_argument("--json", action="store_true", help="Print the whole result as JSON (reward values included).")
    args = parser.parse_args(argv)
    if not args.run:
        parser.error("--run is required")
    from vime_core.rescore import describe, rescore_run
    from vime_core.storage.endpoint import resolve

    endpoint = resolve(args.storage_endpoint_url, args.storage_region)
    try:
        result = rescore_run(args.storage_uri, args.run, args.custom_rm_path, args.rollout_ids, endpoint)
    except ValueError as exc:  # a flag, the run's files or the reward function: said in one line
        sys.stderr.write(f"[vime] rescore: {exc}\n")
        return 1
    print(json.dumps(result, indent=2, default=str) if args.json else "\n".join(describe(result)))
    return 0


def _add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-uri", default="runs")
    parser.add_argument(
        "--storage-endpoint-url",
        default="",
        help="S3 endpoint for an s3:// storage URI (default $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL).",
    )
    parser.add_argument(
        "--storage-region", default="", help="S3 region (default $AWS_REGION, else $AWS_DEFAULT_REGION)."
    )
    parser.add_argument("--run", default=None)


def _store(args):
    from vime_core.storage import BatchStore
    from vime_core.storage.endpoint import resolve

    return BatchStore(args.storage_uri, endpoint=resolve(args.storage_endpoint_url, args.storage_region))


def cmd_lineage(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="vime lineage",
        description="Lineage queries over the batch index (no batch is read, except by --turns).",
    )
    _add_storage_arguments(parser)
    q = parser.add_mutually_exclusive_group(required=True)
    q.add_argument("--weight-version", type=int, help="Batches produced by this weight version.")
    q.add_argument("--prompts-seen-twice", action="store_true", help="Prompt ids seen in two or more batches.")
    q.add_argument("--reward-by-iteration", action="store_true", help="Mean reward per rollout id.")
    q.add_argument("--batches", action="store_true", help="The index itself.")
    q.add_argument(
        "--quarantined",
        action="store_true",
        help="Stored batches set aside because they could not be trained on, with the reason.",
    )
    q.add_argument(
        "--ledger",
        action="store_true",
        help="The run's compute ledger per rollout id (needs --run): tokens generated, trained and discarded by "
        "cause, device-seconds per phase, from its iteration records, beside the token counts of its stored "
        "batches (vime_core/report/ledger_query.py).",
    )
    q.add_argument(
        "--turns",
        type=int,
        metavar="ROLLOUT_ID",
        help="Read this rollout's stored batch (needs --run) and show each sample turn by turn: the response "
        "token spans the model generated and those a tool appended, their trained (loss mask 1) token "
        "count and text (vime_core/data/turns.py). A single-turn sample shows one model turn.",
    )
    parser.add_argument(
        "--sample",
        type=int,
        nargs="+",
        metavar="ROW",
        help="With --turns: only these rows of the batch (0-based; groups in order).",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help=(
            "With --turns: the tokenizer folder or hub id that decodes the text (default: the batch's model_id; when "
            "none loads, token ids only)."
        ),
    )
    args = parser.parse_args(argv)
    if args.turns is None and (args.sample is not None or args.tokenizer is not None):
        parser.error("--sample and --tokenizer go with --turns")
    if (args.turns is not None or args.ledger) and not args.run:
        parser.error(f"--{'turns' if args.turns is not None else 'ledger'} needs --run")
    from vime_core.storage import lineage

    store = _store(args)
    if args.turns is not None:
        result = _sample_turns(parser, store, args)
    elif args.weight_version is not None:
        result = lineage.batches_by_weight_version(store, args.weight_version, run=args.run)
    elif args.prompts_seen_twice:
        result = lineage.prompts_seen_twice(store, run=args.run)
    elif args.reward_by_iteration:
        result = lineage.reward_by_iteration(store, run=args.run)
    elif args.quarantined:
        result = store.quarantined(run=args.run)
    elif args.ledger:
        from vime_core.report.ledger_query import ledger_table
        from vime_core.storage.endpoint import resolve

        result = ledger_table(store, args.run, resolve(args.storage_endpoint_url, args.storage_region))
    else:
        result = store.index()
    rows = result.to_pylist() if hasattr(result, "to_pylist") else result
    print(json.dumps(rows, indent=2, default=str))
    return 0


def _sample_turns(parser: argparse.ArgumentParser, store, args) -> list[dict]:
    """`vime lineage --turns`: the chosen samples of one stored batch, turn by turn."""
    batch, lineage = store.read(args.run, args.turns)
    num_rows = len(batch["tokens"])
    rows = args.sample if args.sample is not None else list(range(num_rows))
    outside = [r for r in rows if not 0 <= r < num_rows]
    if outside:
        parser.error(f"--sample {outside[0]}: batch {args.turns} of run {args.run!r} has rows 0..{num_rows - 1}")
    decode = _decoder(args.tokenizer or lineage.get("model_id") or "")
    return [sample_turns(batch, r, decode) for r in rows]


def _decoder(tokenizer_path: str):
    """token ids -> text with the tokenizer at `tokenizer_path` (special tokens shown), or None
    (said on stderr) when it does not load."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as exc:  # no such folder, no hub access, not a tokenizer
        sys.stderr.write(
            f"[vime] no text: tokenizer {tokenizer_path!r} did not load ({type(exc).__name__}); "
            f"token ids only (--tokenizer names another)\n"
        )
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def cmd_cluster(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vime cluster", description="A local Ray head on loopback.", allow_abbrev=False
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument(
        "--num-gpus", type=int, default=1, help="Device slots to declare (GPUs, or slots on CPU machines)."
    )
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument(
        "--temp-dir",
        default=local_head.default_temp_dir(),
        help=f"The head's Ray temp dir (sessions, logs; names the head for down/status). "
        f"Default ${local_head.TEMP_DIR_ENV}, else {local_head.DEFAULT_TEMP_DIR}.",
    )
    args = parser.parse_args(argv)
    if args.action == "up":
        print(local_head.start_local_head(num_gpus=args.num_gpus, num_cpus=args.num_cpus, temp_dir=args.temp_dir))
    elif args.action == "down":
        local_head.stop_local_head(temp_dir=args.temp_dir)
    else:
        addr = local_head.head_running(args.temp_dir)
        print(addr or "no local Ray head")
        return 0 if addr else 1
    return 0


def cmd_teardown(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vime teardown", allow_abbrev=False)
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--ray-address", default="auto")
    args = parser.parse_args(argv)
    from flows.teardown import teardown

    print(teardown(args.run_name, args.ray_address))
    return 0


def cmd_prune(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="vime prune",
        description="Remove stored batches by run and/or age (dry run unless --yes).",
    )
    _add_storage_arguments(parser)
    parser.add_argument("--older-than-days", type=float, default=None)
    parser.add_argument("--yes", action="store_true", help="Really delete.")
    args = parser.parse_args(argv)
    from datetime import timedelta

    from vime_core.storage.retention import prune

    older = timedelta(days=args.older_than_days) if args.older_than_days is not None else None
    print(json.dumps(prune(_store(args), run=args.run, older_than=older, dry_run=not args.yes), indent=2, default=str))
    return 0


COMMANDS = {
    "train": cmd_train,
    "replay": cmd_replay,
    "rescore": cmd_rescore,
    "lineage": cmd_lineage,
    "cluster": cmd_cluster,
    "teardown": cmd_teardown,
    "prune": cmd_prune,
}


def main(argv: list[str] | None = None) -> int:
    # before a flow runs: Prefect's temporary server reads these when it starts (flows/settings.py)
    apply_env_defaults()

    # Before anything imports Ray: without these a driver resolved the loopback head's address
    # to the machine's other interface and waited for it forever (on a host where nothing had
    # sourced infra/env.sh).
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
