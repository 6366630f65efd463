"""The race that ``make demo`` runs (``pgc_lab.demo``): ``python benchmarks/demo.py --help``."""

from pgc_lab.demo import main

if __name__ == "__main__":
    main()
