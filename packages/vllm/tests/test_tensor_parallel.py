"""Tensor parallelism 2 on vLLM's CPU build: each rank holds half the heads of every projection, the
SwiftKV K/V projection split by K/V head as vLLM splits `k_proj`; the tokens and logprobs stay the
reference's (so equal to tensor parallelism 1's, which `test_against_reference` holds to it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from helpers import PROMPTS, assert_matches_reference, engine, generate, write_checkpoint
from pathlib import Path

if __name__ == "__main__":  # the ranks are spawned processes that import this file
    path, config, state = write_checkpoint(
        Path({path!r}), model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2,
        key_value_group_size=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    )
    with engine(path, tensor_parallel_size=2, distributed_executor_backend="mp",
                kv_sharing_fast_prefill=True) as llm:
        got = generate(llm, PROMPTS, 6)
    assert_matches_reference(config, state, got, PROMPTS, 6)
"""


def test_tensor_parallel_2_gives_the_reference_tokens(tmp_path):
    script = tmp_path / "tp2.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), path=str(tmp_path / "ckpt")))
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the ranks are worker processes
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0",  # one core per rank
    }
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=600)
