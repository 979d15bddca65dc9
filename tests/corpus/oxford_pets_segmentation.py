# Source: keras-team/keras-io examples/vision/oxford_pets_image_segmentation.py
#         (commit 0c3c019ffc3f2650b5bfe3c822e0c60a815cf9e8, its last form with a Python
#         loader: the `OxfordPets` Sequence; its Keras 3 form reads the files with tf.data
#         instead), "Image segmentation with a U-Net-like architecture".
#         The model (`get_model`), loader class and compile of the source; the Oxford-IIIT
#         Pets images and trimaps replaced by synthetic JPEG and PNG files.
"""Image segmentation with a U-Net-like architecture: an Xception-style
encoder (SeparableConv2D, BatchNormalization, max pooling, residual
projections) and a decoder (Conv2DTranspose, UpSampling2D), a per-pixel
softmax over 3 classes, `sparse_categorical_crossentropy` on integer masks
with rmsprop, no metrics. The training data is the source's loader, a
`keras.utils.PyDataset` (Keras 3's name for the source's
`keras.utils.Sequence`) that decodes each batch's image and mask files with
`load_img` in Python, given to `model.fit` as the source gives it, and to
tfmulti by the dataset function; the test split is the same class over
held-out files. tfmulti picks the source's loss from the softmax and the
integer masks; it is given the source's optimizer (`TFMULTI`).

Changes from the source, besides the data: `img_size` is (16, 16), the
smallest the U-Net takes (a multiple of 16; the source's is (160, 160)), as
the tests train it on CPUs; `OxfordPets` calls
`super().__init__(**kwargs)`, as Keras 3 asks of a PyDataset, and takes
`augment` and `seed`: with `augment`, each image is flipped horizontally
together with its mask, with probability 1/2 drawn from `seed` (the source
has no augmentation; this is the Python augmentation a PyDataset is for);
`load_img` is Keras 3's `keras.utils.load_img`. The source trains 15 epochs
with its validation files as `validation_data` and a checkpoint of the best
`val_loss`; here 2 epochs, and the held-out files are evaluated after
training instead.

Synthetic data: 512 training and 128 test "pets", each a JPEG of 20x20 RGB
(resized to `img_size` by `load_img`, as the source's photos are): a bright
disk of random center, radius and color over dark noise, and its trimap, a
grayscale PNG of 1 (the pet), 2 (background) and 3 (the border between
them, about 2 pixels wide), as Oxford-IIIT's trimaps are. The files are
written by `keras.utils.save_img` under a temporary folder of this process,
one per seed, removed at its exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import keras
import numpy as np
from keras import layers

img_size = (16, 16)
num_classes = 3
batch_size = 32
FILE_SIZE = 20  # the written images' side, resized to img_size as they are read
COMPILE = dict(optimizer="rmsprop", loss="sparse_categorical_crossentropy")
FIT = dict(batch_size=batch_size, epochs=2)
TFMULTI = dict(optimizer="rmsprop")
CHAIN = True  # one tensor crosses between blocks: the residual is the block's output
HEAVY = True
"""Each compile traces the U-Net for 4.5-5 s on the suite's 2-core CPU (a step then runs in
0.06 s): the corpus' 2-worker cluster and the pipeline's export leave it out (its PyDataset on
2 workers: tests/integration/test_loaders.py; its pipeline and its export: the other tests)."""
# Its BatchNormalization layers' moving statistics lag the training for hundreds of steps,
# so after 2 short epochs the test loss says little: the training loss is compared too
# (tests/corpus/harness.py).
COMPARE_TRAIN_LOSS = True

_FOLDERS: dict[int, str] = {}
"""The folder of each seed's files, written once in this process."""


class OxfordPets(keras.utils.PyDataset):
    """Helper to iterate over the data (as Numpy arrays)."""

    def __init__(self, batch_size, img_size, input_img_paths, target_img_paths,
                 augment=False, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.batch_size = batch_size
        self.img_size = img_size
        self.input_img_paths = input_img_paths
        self.target_img_paths = target_img_paths
        self.augment = augment
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.target_img_paths) // self.batch_size

    def __getitem__(self, idx):
        """Returns tuple (input, target) correspond to batch #idx."""
        i = idx * self.batch_size
        batch_input_img_paths = self.input_img_paths[i: i + self.batch_size]
        batch_target_img_paths = self.target_img_paths[i: i + self.batch_size]
        x = np.zeros((self.batch_size,) + self.img_size + (3,), dtype="float32")
        for j, path in enumerate(batch_input_img_paths):
            img = keras.utils.load_img(path, target_size=self.img_size)
            x[j] = img
        y = np.zeros((self.batch_size,) + self.img_size + (1,), dtype="uint8")
        for j, path in enumerate(batch_target_img_paths):
            img = keras.utils.load_img(path, target_size=self.img_size, color_mode="grayscale")
            y[j] = np.expand_dims(img, 2)
            # Ground truth labels are 1, 2, 3. Subtract one to make them 0, 1, 2:
            y[j] -= 1
        if self.augment:  # not in the source: a horizontal flip of image and mask together
            flip = self.rng.random(self.batch_size) < 0.5
            x[flip], y[flip] = x[flip, :, ::-1], y[flip, :, ::-1]
        return x, y


def get_model(img_size, num_classes):
    inputs = keras.Input(shape=img_size + (3,))

    ### [First half of the network: downsampling inputs] ###

    # Entry block
    x = layers.Conv2D(32, 3, strides=2, padding="same")(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    # Blocks 1, 2, 3 are identical apart from the feature depth.
    for filters in [64, 128, 256]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(filters, 1, strides=2, padding="same")(
            previous_block_activation
        )
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    ### [Second half of the network: upsampling inputs] ###

    for filters in [256, 128, 64, 32]:
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.UpSampling2D(2)(x)

        # Project residual
        residual = layers.UpSampling2D(2)(previous_block_activation)
        residual = layers.Conv2D(filters, 1, padding="same")(residual)
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    # Add a per-pixel classification layer
    outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)

    # Define the model
    model = keras.Model(inputs, outputs)
    return model


def build():
    """The source's model at the corpus' `img_size`."""
    return get_model(img_size, num_classes)


def _write_pets(folder, count, rng):
    """`count` pets under `folder`: pet_K.jpg, the image, and pet_K.png, its trimap."""
    rows, cols = np.mgrid[:FILE_SIZE, :FILE_SIZE] / FILE_SIZE  # in image sides
    border = 1 / FILE_SIZE
    for k in range(count):
        center = rng.uniform(0.375, 0.625, 2)
        radius = rng.uniform(0.225, 0.375)
        distance = np.hypot(rows - center[0], cols - center[1])
        trimap = np.where(distance < radius - border, 1,
                          np.where(distance > radius + border, 2, 3))
        image = rng.uniform(0, 60, (FILE_SIZE, FILE_SIZE, 3))
        image[distance < radius] = rng.uniform(150, 255, 3)
        keras.utils.save_img(os.path.join(folder, f"pet_{k:04d}.jpg"), image, scale=False)
        keras.utils.save_img(os.path.join(folder, f"pet_{k:04d}.png"), trimap[..., None],
                             scale=False)


def _folder(seed):
    """This process's folder of the files of `seed`, written at the first call."""
    if seed not in _FOLDERS:
        folder = tempfile.mkdtemp(prefix=f"oxford_pets_{seed}_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        rng = np.random.default_rng(seed)
        for split, count in (("train", 512), ("test", 128)):
            os.makedirs(os.path.join(folder, split))
            _write_pets(os.path.join(folder, split), count, rng)
        _FOLDERS[seed] = folder
    return _FOLDERS[seed]


def _paths(folder):
    """The image and trimap paths under `folder`, sorted, as the source lists them."""
    names = sorted(os.listdir(folder))
    return ([os.path.join(folder, n) for n in names if n.endswith(".jpg")],
            [os.path.join(folder, n) for n in names if n.endswith(".png")])


def data(seed=0):
    """The training pets as the source's loader, with random flips drawn from
    `seed`; the test pets as the same loader, unaugmented."""
    folder = _folder(seed)
    train = OxfordPets(batch_size, img_size, *_paths(os.path.join(folder, "train")),
                       augment=True, seed=seed)
    test = OxfordPets(batch_size, img_size, *_paths(os.path.join(folder, "test")))
    return {"train": train, "test": test, "num_classes": num_classes}
