# The two commands of the README. Both install what is missing first.
#   make demo   a server and a client exchanging messages over RDMA
#   make test   every test, RDMA tests on real verbs (Soft-RoCE VM if needed)
.PHONY: demo test deps

deps:
	@tools/deps.sh

demo: deps
	@tools/demo.sh

test: deps
	@tools/test.sh $(ARGS)
