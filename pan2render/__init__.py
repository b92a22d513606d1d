"""pan2-render: a batch render farm for PAN2 / Wan2.2 videos."""

__version__ = "0.1.0"
