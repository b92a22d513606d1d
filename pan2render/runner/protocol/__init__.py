"""What crosses between the driver and its workers: the calls and replies, failure records, step
reports, artifact names and checks, what a finished video says about itself. No torch, no Ray at import."""
