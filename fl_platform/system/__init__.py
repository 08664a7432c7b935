"""The system model: client speeds and bandwidths, and simulated round time (docs/compression.md)."""

from fl_platform.system.config import DistConf, SystemConf, system_schemas
from fl_platform.system.model import (
    ClientProfile,
    ClientTime,
    SystemModel,
    build_system,
    read_trace,
    samples_processed,
)

__all__ = ["ClientProfile", "ClientTime", "DistConf", "SystemConf", "SystemModel", "build_system", "read_trace",
           "samples_processed", "system_schemas"]
