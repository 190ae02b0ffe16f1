"""The host fingerprint every summary.json and record stores (pipesgd/observability/hostinfo.py):
the build versions read from torch's config, this host's fields, and which of them make a kind of
host (the records that carry it: tests/lab/test_host_fingerprint.py)."""

import torch

from pipesgd.observability import hostinfo

SHOW = """PyTorch built with:
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 architecture applications
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
  - CPU capability usage: AVX512
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl,
"""
HOST_A = {"cpu_model": "Xeon A", "cores": 2, "machine": "x86_64", "torch": "2.13.0", "cpu_capability": "AVX512",
          "blas": "mkl", "mkl": "2024.2", "onednn": "v3.12.0"}
HOST_B = HOST_A | {"cpu_model": "EPYC B", "cpu_capability": "AVX2", "cores": 16}


def test_the_build_versions_are_read_from_torchs_config():
    assert hostinfo.parse_build(SHOW) == {"blas": "mkl", "mkl": "2024.2-Product Build 20240605", "onednn": "v3.12.0"}
    assert hostinfo.parse_build("PyTorch built with:\n  - GCC 13\n") == {"blas": None, "mkl": None, "onednn": None}


def test_the_fingerprint_of_this_host():
    here = hostinfo.fingerprint()
    assert set(hostinfo.KIND_FIELDS) <= set(here) and here["cores"] >= 1
    assert here["torch"] == torch.__version__
    assert here["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert here["cpu_model"] and here["cpu_model"] != hostinfo.UNKNOWN


def test_the_kind_leaves_out_the_core_count_but_not_the_cpu():
    assert hostinfo.host_kind(HOST_A) == hostinfo.host_kind(HOST_A | {"cores": 64})
    assert hostinfo.host_kind(HOST_A) != hostinfo.host_kind(HOST_B)
    assert hostinfo.host_kind(None) == hostinfo.UNKNOWN
    assert hostinfo.kind_differences(HOST_A, HOST_B) == ["cpu_model: Xeon A -> EPYC B", "cpu_capability: AVX512 -> AVX2"]
