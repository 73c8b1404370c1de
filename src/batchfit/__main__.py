from batchfit.cli import console

console()
