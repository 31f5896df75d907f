from deepr.cli import main

main()
