"""The data source reads prompt files from real S3 (SeaweedFS) through fsspec, exactly as from a
local folder: JSONL and Parquet, with the endpoint and credentials from the environment."""

from __future__ import annotations

import json
import uuid

import pytest

from vime_core.config import load_config
from vime_core.data.data_source import DataSource, load_prompt_rows

pytestmark = pytest.mark.slow

ROWS = [{"prompt_id": f"q{i}", "prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(4)]


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_prompt_files_on_s3(s3_env, tmp_path):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = s3_env.storage_uri(f"prompts-{uuid.uuid4().hex[:8]}")
    jsonl, parquet = f"{base}/p.jsonl", f"{base}/p.parquet"
    with fsspec.open(jsonl, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    local = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), local)
    with fsspec.open(parquet, "wb") as f:
        f.write(local.read_bytes())

    cfg = load_config(
        overrides={"prompt_data": jsonl, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_shuffle": False}
    )
    src = DataSource(cfg, tokenizer=CharTokenizer())
    groups = src.get_groups(2)
    assert [g[0].prompt_id for g in groups] == ["q0", "q1"]
    assert groups[1][0].tokens == [ord(c) for c in "1+1="]
    from_parquet = load_prompt_rows(parquet, cfg)
    assert [(r.prompt_id, r.prompt, r.label) for r in from_parquet] == [
        (r["prompt_id"], r["prompt"], r["label"]) for r in ROWS
    ]
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        load_prompt_rows(f"{base}/missing.jsonl", cfg)
