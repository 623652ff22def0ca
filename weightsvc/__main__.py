from weightsvc.cli.main import main

main()
