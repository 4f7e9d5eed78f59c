from ifb.cli import main

main()
