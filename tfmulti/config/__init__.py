"""The run's configuration, without TensorFlow: `TrainConfig` and its checks
(`train_config`), the command-line flags generated from it (`flags`), and the
user's model, dataset and loss functions named by strings (`user_functions`)."""
