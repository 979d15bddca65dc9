"""A training run: assembled from a `TrainConfig` (`run`), trained and
published (`train`), custom loops (`loops`), backups that survive kills
(`backup`) and SavedModel export (`export`)."""
