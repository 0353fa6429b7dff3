"""swiftkv_fast: the SwiftKV inference engine (continuous batching, chunked prefill, prefix caching,
SwiftKV early exit and AcrossKV on a paged KV cache).

    from swiftkv_fast import LLM, SamplingParams
    llm = LLM(num_key_value_layers=15)
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from swiftkv_fast.llm import LLM
from swiftkv_fast.outputs import CompletionOutput, RequestMetrics, RequestOutput
from swiftkv_fast.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
