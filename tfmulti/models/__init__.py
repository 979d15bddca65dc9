"""Models: the built-in builders and the compile helper (`builders`), the
byte-level transformer language model (`transformer`) and optimizer helpers
(`optimizers`)."""
