"""The example tasks the recipes train: scikit-learn's digits with a small CNN (``digits``, the default, no
download) and ResNet-18 on CIFAR-10 (``cifar``, torchvision's loader). Each module is imported only when used
(``lightning_pgc.examples.digits.DigitsCNN`` in a recipe), so ``import lightning_pgc`` needs neither
scikit-learn nor torchvision."""
