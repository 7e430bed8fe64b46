"""modelfleet: a control plane for fleets of GPU machines that serve large language models."""

__version__ = "0.1.0"
