module disagg.dev/capsrunc

go 1.26.0
