from jex.cli import main

main()
