"""Every private vLLM symbol the package reads itself, each pinned by a contract."""
