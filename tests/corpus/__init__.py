"""The corpus: published keras-io example programs, their models as published,
their downloads replaced by synthetic data of the same shapes with a rule a
model can learn in a few steps. Each module offers tfmulti's hooks
(`build`, the model function; `data`, the dataset function) and what plain
Keras needs to run it as published (`COMPILE`, `FIT`; `TFMULTI`: the flags a
user passes tfmulti for it, where there are any; `CHAIN`: whether its model
is a chain of layers a pipeline can cut; `COMPARE_TRAIN_LOSS`, where set:
its comparison takes the training loss too, as the harness says), so that
`tests/integration/test_corpus.py` can train it through every path and
compare with plain Keras on one device.

Each module's header names its source file in keras-team/keras-io and the
commit read. The model code follows the source layer for layer, with the
same classes, arguments and signatures (a layer whose `__init__` takes no
`**kwargs` stays so); only the data loading is replaced, and sizes the
published code takes from its data (sequence length, number of rows) come
from the synthetic data. The code is written for this repository rather than
pasted from the source (the source text is not copied into tfmulti's tree).

Programs (module: what it exercises):
- `mnist_convnet`: a Sequential convnet, one-hot labels, softmax, `num_classes=10`;
- `timeseries_classification`: Conv1D + BatchNormalization, softmax, callbacks
  that watch `val_loss` with `validation_split=0.2`;
- `text_transformer`: its own `TransformerBlock` and `TokenAndPositionEmbedding`
  (no `**kwargs`, no `get_config`), softmax;
- `structured_data`: 13 named inputs (one of strings) fed from a dict, lookup
  and `Normalization` layers adapted on the data inside the model, a sigmoid
  output;
- `vae`: a subclassed model with its own `train_step` and no labels;
- `denoising_autoencoder`: a convolutional autoencoder whose labels are
  images, with the source's `binary_crossentropy` given to tfmulti;
- `gan`: a subclassed model with no `call`, its own
  `compile(d_optimizer, g_optimizer, loss_fn)` and `train_step`, logs of two
  trackers and no `loss`; its model function returns it compiled
  (`COMPILE = None`); images without labels, no test split;
- `functional_api_multi_io`: three named inputs (two variable-length word-id
  sequences, LSTMs) and two named outputs returned as a dict, compiled by its
  author with a dict of losses and of loss weights (`COMPILE = None`); data
  and labels are dicts by name;
- `imbalanced_classification`: an MLP on a rare positive class (~7 %), the
  source's `class_weight` (1 / count) in `fit` and in tfmulti's config, counts,
  precision and recall as metrics;
- `masking_and_padding`: `Embedding(mask_zero=True)`, a custom layer that
  passes the mask on, an LSTM that skips the padded steps; zero-padded
  sequences of varying length; a chain the pipeline cuts with the mask;
- `built_in_methods_add_loss`: an MLP with a layer that calls `add_loss`
  (0.1 x the sum of its inputs over the batch), a loss from logits;
- `oxford_pets_segmentation`: a U-Net (residual blocks, BatchNormalization)
  with a per-pixel softmax, trained from the source's `keras.utils.PyDataset`,
  which decodes image and mask files in Python and flips them together; the
  test split is a PyDataset too;
- `basic_ranking`: a recommender (keras-rs' tutorial, plain Keras layers): a
  subclassed model of two embedding tables (users, movies) and an MLP, dict
  inputs of ids, compiled by its author with Adagrad, a mean squared error and
  an RMSE metric (`COMPILE = None`); a regression (`LOSS_OF_THE_MEAN`);
- `collaborative_filtering`: keras-io's MovieLens recommender, as published:
  a subclassed model of four tables (two regularized) called on an array of
  (user, movie) pairs, a batch-wide `tf.tensordot` (each prediction depends on
  its batch: `BATCH_DEPENDENT`), a sigmoid regression under a binary
  cross-entropy;
- `dcn_criteo`: keras-rs' Deep & Cross Network tutorial (keras-io), its `DCN`
  as published, on Criteo-shaped clicks: a subclassed model of 39 embedding
  tables (13 integer and 26 categorical features, hashed to 2,000 rows at
  most), keras-rs' `FeatureCross` and an MLP, dict inputs of ids, compiled by
  its author with AdamW, a mean squared error and an RMSE metric
  (`COMPILE = None`); a regression of the click rate (`LOSS_OF_THE_MEAN`).
  It imports keras-rs, as published (the `test` extra installs it).
"""

PROGRAMS = ("mnist_convnet", "timeseries_classification", "text_transformer",
            "structured_data", "vae", "denoising_autoencoder", "gan",
            "functional_api_multi_io", "imbalanced_classification", "masking_and_padding",
            "built_in_methods_add_loss", "oxford_pets_segmentation", "basic_ranking",
            "collaborative_filtering", "dcn_criteo")
