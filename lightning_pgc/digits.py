"""The former import path of :mod:`lightning_pgc.examples.digits`, kept so that code importing
``lightning_pgc.digits`` keeps working. New code and recipes use :mod:`lightning_pgc.examples.digits`."""

from lightning_pgc.examples.digits import DigitsCNN, DigitsDataModule, load_digits_tensors, log_train_loss

__all__ = ["DigitsCNN", "DigitsDataModule", "load_digits_tensors", "log_train_loss"]
