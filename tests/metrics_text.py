"""Reading `/metrics` in tests."""


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus' text format -> {'name{labels}': value}; comments and blank lines skipped."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
