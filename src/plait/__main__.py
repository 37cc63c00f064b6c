from plait.cli.main import main

main()
