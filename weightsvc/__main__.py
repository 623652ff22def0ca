from weightsvc._cli import main

main()
