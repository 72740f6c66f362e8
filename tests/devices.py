"""The devices tests judge launches on (the watchdog's preflight, the agent step's card rules), written once: what
`ling_common.device.detect` reports for each (kind, name, memory, shared memory per block, compute capability)."""
from ling_common.device import Device
from ling_watchdog.memory import GiB

GB10 = Device("unified", "NVIDIA GB10", None, 101_376, capability=(12, 1))  # a Spark: memory shared with the host
H200 = Device("discrete", "NVIDIA H200", 141 * GiB, 232_448, capability=(9, 0))
H100 = Device("discrete", "NVIDIA H100 80GB HBM3", 85_017_493_504, 232_448, capability=(9, 0))  # 79.2 GiB, as seen
B200 = Device("discrete", "NVIDIA B200", 180 * GiB, 232_448, capability=(10, 0))  # FlashInfer MLA's compute capability
CPU = Device("cpu")
