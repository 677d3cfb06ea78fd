"""MFU's peak table: each GPU, by the name torch.cuda.get_device_name() reports, gets its own datasheet figure;
a name the table lacks gets none (no MFU) rather than a neighbour's."""

from __future__ import annotations

import pytest

from dist_train.telemetry.flops import peak_flops

# name -> dense bf16, tf32, fp32 peak (TFLOP/s), from the datasheets cited in dist_train/telemetry/flops.py
DATASHEET = {
    "NVIDIA H100 80GB HBM3": (989, 494, 67),
    "NVIDIA H100 PCIe": (756, 378, 51),
    "NVIDIA H100 NVL": (835, 417, 60),
    "NVIDIA H200": (989, 494, 67),
    "NVIDIA H200 NVL": (835, 417, 60),
    "NVIDIA A100-SXM4-80GB": (312, 156, 19.5),
    "NVIDIA A100-SXM4-40GB": (312, 156, 19.5),
    "NVIDIA A100-PCIE-40GB": (312, 156, 19.5),
    "NVIDIA A100 80GB PCIe": (312, 156, 19.5),
    "NVIDIA L40S": (362, 183, 91.6),
    "NVIDIA L40": (181, 90.5, 90.5),
    "NVIDIA L4": (121, 60, 30.3),
    "NVIDIA A10": (125, 62.5, 31.2),
    "NVIDIA GeForce RTX 4090": (165.2, 82.6, 82.6),
}


@pytest.mark.parametrize("name", DATASHEET)
def test_every_gpu_gets_its_own_figure(name):
    bf16, tf32, fp32 = (t * 1e12 for t in DATASHEET[name])
    assert peak_flops(name, "bf16") == pytest.approx(bf16)
    assert peak_flops(name, "fp16") == pytest.approx(bf16)
    assert peak_flops(name, "fp32", allow_tf32=True) == pytest.approx(tf32)
    assert peak_flops(name, "fp32") == pytest.approx(fp32)


def test_neighbours_by_substring_are_not_confused():
    sxm = peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak_flops("NVIDIA H100 PCIe", "bf16") != sxm
    assert peak_flops("NVIDIA H100 NVL", "bf16") != sxm
    assert peak_flops("NVIDIA H200 NVL", "bf16") != peak_flops("NVIDIA H200", "bf16")
    assert peak_flops("NVIDIA L40", "bf16") != peak_flops("NVIDIA L4", "bf16")
    assert peak_flops("NVIDIA L40S", "bf16") != peak_flops("NVIDIA L40", "bf16")


@pytest.mark.parametrize("name", [
    "cpu", "", "NVIDIA A10G",  # AWS's A10G: no NVIDIA datasheet to take a figure from
    "NVIDIA H100", "NVIDIA B200", "NVIDIA GeForce RTX 3090", "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
])
def test_a_name_the_table_lacks_gives_no_figure(name):
    assert peak_flops(name, "bf16") is None
