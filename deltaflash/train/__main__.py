from deltaflash.train.cli import main

main()
