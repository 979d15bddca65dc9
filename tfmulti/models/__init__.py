"""Models: the built-in builders and the compile helper (`builders`), the
byte-level transformer language model (`transformer`) optimizer helpers
(`optimizers`), gradient accumulation (`accumulation`) and the model a
`TrainConfig` names (`from_config`)."""
